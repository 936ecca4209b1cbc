/* AMX tiles, shared by the bf16 linears (skinny_linear.c) and the quantized ones (grouped_linear.c): the tile
   configuration's layout and the per-process permission Linux asks for before a thread may use tile data. */
#ifndef TGI_VLM_AMX_H
#define TGI_VLM_AMX_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether this process may use AMX tile data (asked once per file that includes this; the answer is per process). */
static inline int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}
#endif
