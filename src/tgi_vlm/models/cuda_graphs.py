"""CUDA-graph decode: capture the language model's decode forward per batch size, replay by padding.

Decode-only steps with B ≤ the largest captured size replay the graph of the next captured size
S ≥ B; anything else (prefill chunks, mixed steps, B above the largest size, graphs disabled)
runs eagerly. The bookkeeping is plain, device-agnostic code: `plan_replay` decides, and
`StaticDecodeInputs.fill` copies one step into the static buffers of size S. On CPU, tests
build the runner with `DecodeGraphs.eager`, whose "graph" is the same forward run eagerly on the
padded buffers, so everything but the capture itself is exercised without a GPU.

Padding rows (B..S-1) are inert: inputs_embeds 0, positions 0, slot 0 (reserved block 0, see
kv_cache.py), slot_index all 0 and kv length 1, so each padding row attends only to slot 0,
which it has just written itself; adapter index 0 (the base model). Their outputs are sliced off.

Layers read the step context (layers/step_context.py) through `current()`. A graph cannot see a new
Python object at replay, so each size has one graphed context (`StepContext.for_graph`), set around
the forward at capture (and around every eager stand-in replay), whose `row_adapter` is the static
adapter-index buffer `[S]`; `fill` copies the step's adapter indices into it, padding rows 0, and
skips the copy when the buffer already holds them (always, while no adapter is loaded).

The model's attention backend (layers/attention/backend.py) gets `prepare_for_capture(meta, size)`
and `prepare_for_replay(meta, size)` on the host, outside the graph, before capture and before
every replay (flashinfer re-plans its fixed-buffer wrappers there). The torch backend needs
neither: its masks are computed from the static tensors inside the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from loguru import logger

from tgi_vlm.layers.attention import AttentionBackend, AttentionMetadata, DecodeGroup, PagedKVCache
from tgi_vlm.layers.step_context import BASE_ADAPTER, StepContext, using


@dataclass(frozen=True)
class GraphPlan:
    """Replay the graph of batch size `size` for a decode-only step of `batch` sequences."""

    size: int
    batch: int
    kv_width: int  # columns of the step's slot_index; the rest of the static row is padding

    @property
    def pad(self) -> int:
        return self.size - self.batch


def next_captured_size(batch: int, sizes: tuple[int, ...]) -> int | None:
    """Smallest captured size ≥ batch, or None when batch is above the largest (eager)."""
    fitting = [s for s in sizes if s >= batch]
    return min(fitting) if fitting else None


def plan_replay(meta: AttentionMetadata, sizes: tuple[int, ...], max_kv_len: int) -> GraphPlan | None:
    """A GraphPlan when the step is decode-only and fits a captured size, else None (run eagerly)."""
    decode = meta.decode
    if decode is None or meta.prefills or not decode.rows_are_all:
        return None
    batch = int(decode.kv_lens.shape[0])
    kv_width = int(decode.slot_index.shape[1])
    size = next_captured_size(batch, sizes)
    if size is None or kv_width > max_kv_len:
        return None
    return GraphPlan(size=size, batch=batch, kv_width=kv_width)


@dataclass
class StaticDecodeInputs:
    """The buffers one captured graph reads. Allocated once per size; filled before every replay.

    inputs_embeds `[1, S, H]`, position_ids `[1, S]` or `[3, 1, S]` (mrope), slots `[S]`,
    slot_index `[S, max_kv]` (each row the cache slot of positions 0..max_kv-1), kv_lens `[S]`,
    adapters `[S]` (adapter index per row, 0 = base model). `metadata` views exactly these tensors and
    `context.row_adapter` is `adapters`, so the graph sees every refill.
    """

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    slots: torch.Tensor
    slot_index: torch.Tensor
    kv_lens: torch.Tensor
    metadata: AttentionMetadata
    context: StepContext  # graphed: its static_adapters is the adapters buffer
    adapter_list: list[int]  # what `adapters` holds now, on the host (a refill copies only on change)

    @property
    def adapters(self) -> torch.Tensor:
        return self.context.static_adapters

    @classmethod
    def allocate(cls, size: int, hidden: int, position_rows: int, max_kv_len: int, kv_cache: PagedKVCache,
                 dtype: torch.dtype, device: torch.device, backend: AttentionBackend | None = None) -> StaticDecodeInputs:
        long = dict(dtype=torch.long, device=device)
        positions = torch.zeros((1, size), **long)
        if position_rows > 1:
            positions = torch.zeros((position_rows, 1, size), **long)
        slots = torch.zeros(size, **long)
        slot_index = torch.zeros((size, max_kv_len), **long)
        kv_lens = torch.ones(size, **long)
        decode = DecodeGroup(rows=torch.arange(size, **long), slot_index=slot_index, kv_lens=kv_lens, rows_are_all=True,
                             row_list=list(range(size)), kv_len_list=[1] * size)
        metadata = AttentionMetadata(kv_cache=kv_cache, slots=slots, decode=decode, prefills=[], backend=backend)
        embeds = torch.zeros((1, size, hidden), dtype=dtype, device=device)
        context = StepContext.for_graph(size, device)
        return cls(embeds, positions, slots, slot_index, kv_lens, metadata, context, [BASE_ADAPTER] * size)

    @property
    def size(self) -> int:
        return int(self.slots.shape[0])

    def fill(self, plan: GraphPlan, embeds: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata,
             context: StepContext | None = None) -> None:
        """Copy one decode step (`embeds [B, H]`, `position_ids [..., B]`, the step's context: one row
        per sequence; None = every row the base model) in; padding rows get inert values."""
        b, w = plan.batch, plan.kv_width
        if position_ids.shape[:-1] != self.position_ids.shape[:-1]:
            raise ValueError(
                f"decode position ids {tuple(position_ids.shape)} do not match the captured "
                f"{tuple(self.position_ids.shape)}; the graphs were captured for another position layout"
            )
        self.inputs_embeds[0, :b].copy_(embeds)
        self.inputs_embeds[0, b:].zero_()
        self.position_ids[..., :b].copy_(position_ids)
        self.position_ids[..., b:].zero_()
        self.slots[:b].copy_(meta.slots)
        self.slots[b:].zero_()
        self.slot_index[:b, :w].copy_(meta.decode.slot_index)
        self.slot_index[:b, w:].zero_()
        self.slot_index[b:].zero_()
        self.kv_lens[:b].copy_(meta.decode.kv_lens)
        self.kv_lens[b:].fill_(1)
        # The host copy of the lengths, for backend planning without a device read-back.
        self.metadata.decode.kv_len_list = meta.decode.kv_len_list + [1] * plan.pad
        self.metadata.clear_masks()  # eager stand-in only; a real graph recomputes masks on replay
        self._fill_adapters(plan, context)

    def _fill_adapters(self, plan: GraphPlan, context: StepContext | None) -> None:
        if context is not None and context.num_rows != plan.batch:
            raise ValueError(f"the step context has {context.num_rows} rows but the decode step has {plan.batch}")
        step = list(context.adapters) if context is not None else [BASE_ADAPTER] * plan.batch
        wanted = step + [BASE_ADAPTER] * plan.pad
        if wanted != self.adapter_list:
            self.adapters.copy_(torch.tensor(wanted, dtype=torch.long))
            self.adapter_list = wanted


@dataclass
class CapturedDecode:
    """One batch size: its static inputs and how to run it. `run()` returns hidden `[S, H]`;
    for a real graph that is the graph's own output buffer, valid until the next replay."""

    inputs: StaticDecodeInputs
    run: Callable[[], torch.Tensor]


Forward = Callable[[StaticDecodeInputs], torch.Tensor]


class DecodeGraphs:
    """Captured decode forwards by batch size, and the replay path `FlashCausalLM.forward` uses."""

    def __init__(self, entries: dict[int, CapturedDecode], max_kv_len: int, backend: AttentionBackend):
        self.entries = entries
        self.sizes = tuple(sorted(entries, reverse=True))
        self.max_kv_len = max_kv_len
        self.backend = backend  # the model's attention backend, for its prepare_* hooks

    def plan(self, meta: AttentionMetadata) -> GraphPlan | None:
        return plan_replay(meta, self.sizes, self.max_kv_len)

    def replay(self, plan: GraphPlan, embeds: torch.Tensor, position_ids: torch.Tensor,
               meta: AttentionMetadata, context: StepContext | None = None) -> torch.Tensor:
        """Hidden states `[B, H]` of the step: fill, prepare the backend, run, slice the padding off."""
        entry = self.entries[plan.size]
        entry.inputs.fill(plan, embeds, position_ids, meta, context)
        self.backend.prepare_for_replay(entry.inputs.metadata, plan.size)
        return entry.run()[: plan.batch]

    # ----- construction -----
    @classmethod
    def eager(cls, model, sizes: tuple[int, ...], max_kv_len: int) -> DecodeGraphs:
        """The stand-in: same buffers and bookkeeping, the forward run eagerly at every replay."""
        forward = _language_forward(model)
        backend = model.attention
        entries = {}
        for size in sorted(sizes, reverse=True):
            inputs = _allocate(model, size, max_kv_len)
            entries[size] = CapturedDecode(inputs, lambda inputs=inputs: forward(inputs))
        return cls(entries, max_kv_len, backend)

    @classmethod
    def capture(cls, model, sizes: tuple[int, ...], max_kv_len: int) -> DecodeGraphs:
        """Capture one CUDA graph per size, largest first, all in one memory pool."""
        forward = _language_forward(model)
        backend = model.attention
        pool = torch.cuda.graph_pool_handle()
        entries = {}
        with torch.inference_mode():
            for size in sorted(sizes, reverse=True):
                inputs = _allocate(model, size, max_kv_len)
                entries[size] = _capture_one(forward, inputs, backend, pool)
        torch.cuda.synchronize(model.device)
        logger.info("captured CUDA graphs for decode batch sizes {} (max kv length {})", sorted(entries), max_kv_len)
        return cls(entries, max_kv_len, backend)


def _capture_one(forward: Forward, inputs: StaticDecodeInputs, backend: AttentionBackend, pool) -> CapturedDecode:
    backend.prepare_for_capture(inputs.metadata, inputs.size)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up runs: lazy initialisation must not happen inside capture
        for _ in range(2):
            inputs.metadata.clear_masks()
            forward(inputs)
    torch.cuda.current_stream().wait_stream(stream)
    inputs.metadata.clear_masks()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward(inputs)

    def run() -> torch.Tensor:
        graph.replay()
        return output

    return CapturedDecode(inputs, run)


def _language_forward(model) -> Forward:
    def forward(inputs: StaticDecodeInputs) -> torch.Tensor:
        with using(inputs.context):  # the graphed context: layers capture reads of its static buffer
            out = model.language_model(
                inputs_embeds=inputs.inputs_embeds,
                position_ids=inputs.position_ids,
                attn_metadata=inputs.metadata,
                use_cache=False,
            )
        return out.last_hidden_state[0]  # [S, H]

    return forward


def _allocate(model, size: int, max_kv_len: int) -> StaticDecodeInputs:
    return StaticDecodeInputs.allocate(
        size,
        hidden=int(model.text_config.hidden_size),
        position_rows=model.position_rows,
        max_kv_len=max_kv_len,
        kv_cache=model.kv_cache,
        dtype=model.dtype,
        device=model.device,
        backend=model.attention,
    )


def graph_max_kv_len(max_total_tokens: int, kv_cache: PagedKVCache) -> int:
    """Width of the static slot_index: a request never holds more than max_total_tokens positions
    (nor more than the cache), rounded up to whole blocks."""
    block = kv_cache.spec.block_size
    tokens = min(max_total_tokens, kv_cache.num_slots)
    return ((tokens + block - 1) // block) * block


def setup_decode_graphs(model, max_total_tokens: int) -> DecodeGraphs | None:
    """Called at the end of warmup: capture when on CUDA with CUDA_GRAPHS non-empty, else None."""
    sizes = model.config.cuda_graphs
    if not sizes or model.device.type != "cuda":
        return None
    return DecodeGraphs.capture(model, sizes, graph_max_kv_len(max_total_tokens, model.kv_cache))
