"""The dtype a model runs in: `--dtype` when given, otherwise the rule below, with the reason logged.

`resolve_dtype` is pure (the CPU's capability is an argument); `cpu_has_native_bf16` asks the CPU.

The rule when `--dtype` is not given (README, "dtype"; docs/decisions.md, "Default dtype"):

- GPU: TGI's. TGI's shard ignores the checkpoint's `torch_dtype`: `get_model` in TGI's
  server/text_generation_server/models/__init__.py leaves `dtype` None and each model class falls
  back to its `default_dtype`, float16 unless the architecture passes bfloat16 (the Qwen-VLs,
  Idefics3, PaliGemma, the Gemmas, Llama 4, Mllama, DeepSeek V2/V3, DBRX). `TGI_BFLOAT16_MODEL_TYPES`
  lists them; SmolVLM (no TGI entry; an Idefics3 model) is counted with Idefics3.
- CPU with native bfloat16 arithmetic (AMX or AVX512-BF16): bfloat16, whatever the checkpoint holds
  (float32, bfloat16 or float16), as vLLM's CPU backend does. A bfloat16 matmul is ~6x faster there
  than float32 and float16 is no faster than float32 without AMX-FP16 (512x768 @ 768x2048, one core
  of this project's Xeon: 8.1 ms float32, 7.8 ms float16, 1.2 ms bfloat16). A float16 checkpoint
  therefore runs in bfloat16 too: bfloat16 covers float16's whole range (nothing overflows) and
  loses 3 mantissa bits, the same precision every bfloat16 checkpoint is served at.
- Any other CPU: float32. Without native bf16 instructions every bfloat16 op converts to float32 for
  the arithmetic, so it is no faster; and float32 holds every float16 and bfloat16 value exactly, so
  a half-precision checkpoint loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPE_NAMES = ("float32", "bfloat16", "float16")

# model_type values whose TGI model class is built with default_dtype=torch.bfloat16 (or forced to it, Llama 4).
TGI_BFLOAT16_MODEL_TYPES = frozenset({
    "qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm", "paligemma", "gemma", "gemma2", "gemma3", "gemma3_text",
    "llama4", "mllama", "deepseek_v2", "deepseek_v3", "dbrx",
})

# CPU feature flags (torch.cpu.get_capabilities() keys, /proc/cpuinfo flag names) meaning native bf16 math.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # one of DTYPE_NAMES
    reason: str  # for the startup log line


def resolve_dtype(requested: str | None, device: str, checkpoint_dtype: str | None, cpu_has_bf16: bool,
                  model_type: str | None = None) -> DtypeChoice:
    """The dtype to load the model in. `requested` is `--dtype` (None when not given), `checkpoint_dtype`
    the config's `dtype` (None when it names none), `cpu_has_bf16` whether this CPU has native bf16."""
    if requested is not None:
        if requested not in DTYPE_NAMES:
            raise ValueError(f"dtype {requested!r} is not supported; choose one of {', '.join(DTYPE_NAMES)}")
        return DtypeChoice(requested, "--dtype")
    if not device.startswith("cpu"):
        name = "bfloat16" if model_type in TGI_BFLOAT16_MODEL_TYPES else "float16"
        return DtypeChoice(name, f"TGI's default for model type {model_type} on a GPU")
    held = f"{checkpoint_dtype} checkpoint" if checkpoint_dtype else "checkpoint of unstated dtype"
    if cpu_has_bf16:
        return DtypeChoice("bfloat16", f"CPU has native bf16 (AMX / AVX512-BF16); {held}")
    return DtypeChoice("float32", f"CPU has no native bf16 (AMX / AVX512-BF16); {held}")


def checkpoint_dtype(hf_config) -> str | None:
    """The dtype a transformers config says its weights are stored in (its `dtype`, else its text
    config's), as a name; None when it states none."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        value = getattr(config, "dtype", None) if config is not None else None
        if value is not None:
            return str(value).removeprefix("torch.")
    return None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AMX-BF16 or AVX512-BF16).

    torch's own query (`torch.cpu.get_capabilities`, torch >= 2.9) when it exists, else the kernel's
    /proc/cpuinfo flags. Not `torch.ops.mkldnn._is_mkldnn_bf16_supported()`: it is true on any AVX-512
    CPU, where oneDNN emulates bf16 more slowly than float32.
    """
    import torch

    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is not None:
        capabilities = get_capabilities()
        return any(bool(capabilities.get(flag, False)) for flag in NATIVE_BF16_FLAGS)
    return cpuinfo_has_native_bf16(_read_cpuinfo())


def cpuinfo_has_native_bf16(cpuinfo: str) -> bool:
    """From /proc/cpuinfo's text: does the first processor's `flags` line list a native bf16 flag?"""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return any(flag in value.split() for flag in NATIVE_BF16_FLAGS)
    return False


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
