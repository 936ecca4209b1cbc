"""A dense copy of the decoding sequences' keys/values, so decode attention gathers nothing per layer.

Why: the paged cache scatters a sequence over router-chosen blocks, so the reference decode path
copies every decoding sequence's whole context out of the cache (`index_select`) in every layer of
every step before SDPA reads it again: on a 2-core CPU that gather cost as much as SDPA itself
(benchmarks/results/cpu-profile.md). The mirror keeps, per layer, `[rows, Hkv, capacity, D]`
tensors with one row per decoding sequence, and each step copies in only what the row lacks —
normally the one position decoded this step — then SDPA reads the rows in place.

Invariants:
- The paged cache stays the source of truth: the mirror only ever copies from it, after the step's
  K/V were written there, so its content is exactly what the gather path would read.
- A row belongs to one sequence, named by `Sequence.uid` (unique for the process's life: a uid is
  never reused, so a row can never be mistaken for another request's). Row `r` holds that
  sequence's positions `[0, held[r])`; those positions never change while the sequence lives
  (speculation rewrites only positions past the accepted ones, which the mirror has not copied:
  it copies a position only once a decode step runs at or after it).
- Rows `[0, B)` are the step's B decoding sequences (in the mirror's own order; `token_rows` maps
  them to the step's packed rows). Sequences that left are dropped and the last rows moved into
  their place; a sequence not decoding this step (prefilling, speculating) loses its row and is
  copied in again when it comes back. A step sharing no sequence with the rows (another batch's,
  e.g. TGI's one-token liveness Prefill) gathers and leaves the rows alone; a second one in a row
  replaces them.
- The plan is made once per step on the host (`plan`); every layer then applies the same copies
  (`sync_layer`). If a forward stops before its last layer, the next plan starts from empty.
- Memory: at most `budget_bytes` (a share of the KV cache, EngineConfig.decode_mirror); a step
  that would need more runs the gather path and the mirror is released. The backend drops the
  whole mirror when the service holds no batch any more (`release_idle`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgi_vlm.layers.attention.kv_cache import PagedKVCache
from tgi_vlm.layers.attention.metadata import DecodeGroup, decode_mask

_POSITION_ALIGN = 64  # capacity is a multiple of this, at least one multiple past the longest kv_len
_ROW_SLACK = 2  # rows kept beyond the step's count (a few newcomers join without regrowing)


@dataclass
class MirrorStep:
    """One step's plan, shared by every layer."""

    num_rows: int  # B: rows [0, B) attend this step
    width: int  # positions attended: the longest kv_len of the step
    token_rows: torch.Tensor  # [B] long: the packed-token row of mirror row r
    kv_lens: torch.Tensor  # [B] long: kv_len of mirror row r (this step's token included)
    copy_slots: torch.Tensor  # [N] long: cache slots to copy in ...
    # [N * Hkv] long: ... to these rows of the mirror seen as [rows * Hkv * capacity, D]: slot n's head h
    # goes to (row_n * Hkv + h) * capacity + position_n (one index_copy_ per tensor and layer)
    copy_targets: torch.Tensor
    moves: list[tuple[int, int]]  # (from row, to row): rows moved down into the places of leavers
    new_shape: tuple[int, int] | None  # (rows, capacity) when the tensors grow or shrink this step
    masks: dict = field(default_factory=dict)  # (sliding_window, chunk) -> [B, 1, 1, width] bool


class DecodeMirror:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._reset(None)

    def _reset(self, cache: PagedKVCache | None) -> None:
        self.cache = cache
        self.keys: list[torch.Tensor | None] = []  # per layer [rows, Hkv, capacity, D]
        self.values: list[torch.Tensor | None] = []
        self.shape = (0, 0)  # (rows, capacity) of every layer's tensors once synced
        self.row_of: dict[int, int] = {}  # sequence uid -> row
        self.held: list[int] = []  # per row: positions [0, held) are copied
        self.step: MirrorStep | None = None
        self.layers_synced = 0
        self._foreign_steps = 0  # consecutive steps that shared no sequence with the rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def plan(self, group: DecodeGroup, cache: PagedKVCache) -> MirrorStep | None:
        """Host-side plan for a step whose decode group is `group`; None: use the gather path."""
        unfinished = self.step is not None and self.layers_synced != cache.spec.num_layers
        if cache is not self.cache or unfinished:
            self._reset(cache)
        self.step, self.layers_synced = None, 0
        if group.keys is None or self._belongs_elsewhere(group.keys):
            return None
        shape = self._shape_for(len(group.keys), max(group.kv_len_list))
        if _bytes(cache, *shape) > self.budget_bytes:
            self._reset(cache)  # over budget: give the memory back, gather this step
            return None
        try:
            moves = self._assign_rows(group.keys)
            self.step = self._copies(group, cache, shape, moves)
        except BaseException:
            self._reset(cache)  # rows were reassigned but nothing copied: start from empty next time
            raise
        return self.step

    def _belongs_elsewhere(self, keys: list[int]) -> bool:
        """A step that shares no sequence with the mirror's rows, once: another batch's step (TGI's
        liveness Prefill is a one-token batch of its own; a new batch before it joins the running
        one) gathers instead of evicting the running batch's rows. A second such step in a row means
        the rows are gone for good: they are replaced."""
        if not self.row_of or not self.row_of.keys().isdisjoint(keys):
            self._foreign_steps = 0
            return False
        self._foreign_steps += 1
        return self._foreign_steps == 1

    def _shape_for(self, rows: int, longest: int) -> tuple[int, int]:
        """Sticky: keep the current shape while it fits and is not far larger than needed; grow by half
        at least. A change of shape copies the whole mirror, so batches whose longest sequence or size
        come and go must not resize it every few steps."""
        have_rows, have_cap = self.shape
        need_cap = (longest // _POSITION_ALIGN + 1) * _POSITION_ALIGN
        if longest >= have_cap:  # grow by half at least, aligned
            have_cap = -(-max(need_cap, have_cap + have_cap // 2) // _POSITION_ALIGN) * _POSITION_ALIGN
        elif have_cap > 4 * need_cap:
            have_cap = need_cap
        if rows > have_rows:
            have_rows = max(rows + _ROW_SLACK, have_rows + have_rows // 2)
        elif have_rows > 2 * rows + 2 * _ROW_SLACK:
            have_rows = rows + _ROW_SLACK
        return have_rows, have_cap

    def _assign_rows(self, keys: list[int]) -> list[tuple[int, int]]:
        """Rows [0, B) for the step's sequences: kept rows stay where they are unless past B (then
        moved into a leaver's row); newcomers take the remaining rows, holding nothing yet."""
        count, wanted = len(keys), set(keys)
        kept = {uid: row for uid, row in self.row_of.items() if uid in wanted}
        free = sorted(set(range(count)) - set(kept.values()))
        moves = []
        for uid, row in sorted(kept.items(), key=lambda item: item[1]):
            if row >= count:
                kept[uid] = free.pop(0)
                moves.append((row, kept[uid]))
        held = [0] * count
        for uid, row in kept.items():
            held[row] = self.held[self.row_of[uid]]
        for uid in keys:
            if uid not in kept:
                kept[uid] = free.pop(0)
        self.row_of, self.held = kept, held
        return moves

    def _copies(self, group: DecodeGroup, cache: PagedKVCache, shape: tuple[int, int],
                moves: list[tuple[int, int]]) -> MirrorStep:
        """What each row lacks, `[held, kv_len)`, as (slot, row, position) triples; then every row holds all
        of its step's positions."""
        B = len(group.keys)
        order = [0] * B  # mirror row -> index in the group
        for index, uid in enumerate(group.keys):
            order[self.row_of[uid]] = index
        slots, rows, positions = [], [], []
        for row, index in enumerate(order):
            start, end = self.held[row], group.kv_len_list[index]
            slots.append(group.slot_index[index, start:end])
            rows.extend([row] * (end - start))
            positions.extend(range(start, end))
            self.held[row] = end
        device = group.slot_index.device
        long = dict(dtype=torch.long, device=device)
        order_t = torch.tensor(order, **long)
        heads, capacity = cache.spec.kv_heads, shape[1]
        starts = torch.tensor(rows, **long) * (heads * capacity) + torch.tensor(positions, **long)  # head 0
        targets = (starts[:, None] + torch.arange(heads, **long)[None, :] * capacity).reshape(-1)
        return MirrorStep(
            num_rows=B,
            width=max(group.kv_len_list),
            token_rows=group.rows[order_t],
            kv_lens=group.kv_lens[order_t],
            copy_slots=torch.cat(slots),
            copy_targets=targets,
            moves=moves,
            new_shape=shape if shape != self.shape else None,
        )

    def sync_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the step's plan to `layer` (the paged caches `[slots, Hkv, D]` hold this step's K/V
        already); returns its K and V as `[B, Hkv, width, D]` views."""
        step = self.step
        if not self.keys:
            self.keys = [None] * self.cache.spec.num_layers
            self.values = [None] * self.cache.spec.num_layers
        k = self._prepared(self.keys[layer], step, k_cache)
        v = self._prepared(self.values[layer], step, v_cache)
        # cache rows [N, Hkv, D] into (row, head, position) of the mirror
        head_dim = k.shape[-1]
        k.view(-1, head_dim).index_copy_(0, step.copy_targets, k_cache.index_select(0, step.copy_slots).view(-1, head_dim))
        v.view(-1, head_dim).index_copy_(0, step.copy_targets, v_cache.index_select(0, step.copy_slots).view(-1, head_dim))
        self.keys[layer], self.values[layer] = k, v
        self.layers_synced += 1
        if self.layers_synced == self.cache.spec.num_layers and step.new_shape is not None:
            self.shape = step.new_shape
        return k[: step.num_rows, :, : step.width], v[: step.num_rows, :, : step.width]

    @staticmethod
    def _prepared(tensor: torch.Tensor | None, step: MirrorStep, cache: torch.Tensor) -> torch.Tensor:
        """`tensor` with the step's row moves applied, then at the step's shape (what rows hold is kept:
        after the moves every kept row is below B, and no row holds past the new capacity)."""
        if tensor is not None:
            for src, dst in step.moves:
                tensor[dst].copy_(tensor[src])
        if step.new_shape is None and tensor is not None:
            return tensor
        rows, capacity = step.new_shape
        # zeros, not empty: masked positions still enter SDPA's products (weight 0 x NaN would be NaN);
        # past a row's kv_len there is only ever zeros or some earlier finite K/V
        new = cache.new_zeros(rows, cache.shape[1], capacity, cache.shape[2])
        if tensor is not None:
            r, c = min(rows, tensor.shape[0]), min(capacity, tensor.shape[2])
            new[:r, :, :c] = tensor[:r, :, :c]
        return new

    def mask(self, step: MirrorStep, sliding_window: int | None, chunk_size: int | None) -> torch.Tensor:
        """[B, 1, 1, width] bool: the decode mask, in mirror row order."""
        key = (sliding_window, chunk_size)
        if key not in step.masks:
            step.masks[key] = decode_mask(step.kv_lens, step.width, sliding_window, chunk_size)
        return step.masks[key]


def _bytes(cache: PagedKVCache, rows: int, capacity: int) -> int:
    spec = cache.spec
    element = torch.empty((), dtype=spec.dtype).element_size()
    return 2 * spec.num_layers * rows * spec.kv_heads * capacity * spec.head_dim * element
