"""The linear plan: which kernel computes each linear layer (and patch convolution), chosen once at load.

`plan_linears` is the one place that decides; it gives every `nn.Linear` of the model exactly one kernel
(layers/linear/kernels.py), fuses the language model's q/k/v and gate/up siblings where their kernels allow it
(layers/linear/fused.py), and returns a `LinearPlan` read back from the modules themselves, so what it logs is
what runs. The rules, in order, for one layer:

0. a layer a quantized checkpoint's loader gave a `quantized_weight` (quantization/gguf_checkpoint.py,
   quantization/packed_checkpoint.py for AWQ / GPTQ / compressed-tensors, quantization/int8.py for --quantize eetq):
   `int8-grouped(<format>)`, with the native product (`+native`) for decode-sized rows where it loads and the group is
   a multiple of 16 (layers/linear/grouped.py), on any device (quantized checkpoints and --quantize are refused with
   --num-shard > 1);
1. not on CPU, or the CPU speed-ups off (`TGI_VLM_CPU_SPEEDUPS=0`), or a tensor-parallel rank (its plan hooks the
   modules and its weights are DTensors): `torch`;
2. a weight that is not a plain tensor (a subclass: quantized, DTensor, ...) reports a dtype it may not be stored
   in: `torch` (its own `F.linear` dispatch), never packed or fused;
3. float16 (no fast oneDNN float16 path on most CPUs), a dtype oneDNN cannot prepack on this CPU (bf16 without
   AVX-512BW/AVX-NE-CONVERT: `can_pack_weights`), or a weight another module shares (a tied lm-head) where a
   second copy does not fit (`decode_copy` false): `torch-bucketed` for bf16/fp16 (rows padded), else `torch`;
4. a shared weight otherwise: the packed kernel rule 5 gives its dtype (float32: without the decode extras), its plain
   weight kept for the other owner (`...+plain-kept`: the tied lm-head of a 262k vocabulary is the largest product
   of a decode step);
5. bfloat16: `onednn-packed`, with the native bf16 product for decode rows (`onednn-packed+native-skinny`: AMX tiles
   for 1..64 rows, else the AVX512-BF16 loop for 1..4) when the second copy fits (`decode_copy`) and it loads
   (`skinny_bf16`: AVX512-BF16), a tied head included; float32 on an Intel CPU where torch has MKL's packed GEMM and the shape's packed
   layout checks out (`mkl_serves_float32`, `mkl_layout_agrees`): `mkl-packed`, with the native skinny loop for
   decode rows (`mkl-packed+native-skinny`) when the second copy fits in memory (`decode_copy`) and the native
   library loads; float32 elsewhere: `onednn-packed`, with the plain weight kept for one-row products
   (`onednn-packed+gemv`) when `decode_copy`, except on AMD CPUs, where oneDNN's packed product is the fastest
   at every row count, one row included (kernels.mkl_serves_float32 has the figures).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from loguru import logger

from tgi_vlm.layers.linear.fused import GROUPS, FusedMember, FusedProjections, fuse, fused_groups
from tgi_vlm.layers.linear.grouped import GroupedInt8Linear, quantized_weight_of
from tgi_vlm.layers.linear.kernels import (
    BucketedLinear,
    LinearKernel,
    MklPackedLinear,
    MklSkinnyLinear,
    OneDnnPackedGemvLinear,
    OneDnnPackedLinear,
    OneDnnPackedSkinnyLinear,
    PlainWeights,
    TorchLinear,
    can_pack_weights,
    cpu_vendor,
    mkl_layout_agrees,
    mkl_serves_float32,
    same_inputs,
)
from tgi_vlm.layers.linear.modules import KernelLinear, give_kernel, give_patch_kernel, is_patch_embedding

_REDUCED = (torch.bfloat16, torch.float16)
PRIME_BUDGET_S = 3.0  # warmup time for building kernels ahead (the bench model: 1.8 s bf16, 2.8 s fp32 for all)


@dataclass(frozen=True)
class PlanOptions:
    """What the plan may use on this process (layers/cpu.py fills it for CPU serving)."""

    cpu: bool = False  # CPU kernels at all; False: every layer `torch`
    sharded: bool = False
    decode_copy: bool = False  # a second copy fits: float32 decode extras, a tied head packed beside its embedding
    skinny: bool = False  # the native skinny-linear library loads (and is switched on)
    skinny_bf16: bool = False  # its bf16 loop loads too (AVX512-BF16)
    grouped_int8: bool = False  # the native product of int8-grouped (quantized) weights loads


@dataclass(frozen=True)
class LinearPlan:
    """Per layer (qualified name) the kernel it computes with, and the fused groups; read from the modules."""

    kernels: dict[str, str]
    groups: dict[str, str] = field(default_factory=dict)  # "layers.0.self_attn.q_proj+k_proj+v_proj" -> kernel
    patch_convs: dict[str, str] = field(default_factory=dict)
    # nn.Linear subclasses keep their own forward and parameters: nn.MultiheadAttention's out_proj
    # (`NonDynamicallyQuantizableLinear`: its owner reads the weight, its forward never runs), Llama4's router (top-k
    # on its product). With the reason.
    not_planned: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, model: torch.nn.Module) -> LinearPlan:
        kernels, groups, convs, skipped = {}, {}, {}, {}
        for name, module in model.named_modules():
            if isinstance(module, KernelLinear):
                kernels[name] = module.linear_kernel.name
            elif isinstance(module, torch.nn.Linear):
                skipped[name] = f"{type(module).__name__}: a subclass, keeps its own forward"
            elif hasattr(module, "patch_kernel"):
                convs[name] = module.patch_kernel.name
        names = {id(m): n for n, m in model.named_modules()}
        for group in fused_groups(model):
            member_names = [names[id(m)] for m in group.members]
            prefix = member_names[0].rsplit(".", 1)[0]
            groups[f"{prefix}.{'+'.join(n.rsplit('.', 1)[-1] for n in member_names)}"] = group.kernel.name
        return cls(kernels, groups, convs, skipped)

    def counts(self) -> dict[str, int]:
        return dict(sorted(collections.Counter(self.kernels.values()).items()))

    def summary(self) -> str:
        parts = [f"{count} x {name}" for name, count in self.counts().items()]
        if self.groups:
            kinds = collections.Counter(self.groups.values())
            parts.append("fused groups: " + ", ".join(f"{c} x {k}" for k, c in sorted(kinds.items())))
        if self.patch_convs:
            kinds = collections.Counter(self.patch_convs.values())
            parts.append("patch convolutions: " + ", ".join(f"{c} x {k}" for k, c in sorted(kinds.items())))
        if self.not_planned:
            parts.append(f"{len(self.not_planned)} left to their owners ({', '.join(sorted(set(self.not_planned)))})")
        return f"{len(self.kernels)} linear layers: " + "; ".join(parts)


def plan_linears(model: torch.nn.Module, options: PlanOptions, *,
                 language_model: torch.nn.Module | None = None) -> LinearPlan:
    """Give every `nn.Linear` of `model` (exactly that class: subclasses such as nn.MultiheadAttention's out_proj,
    whose owner reads the weight itself, are listed in `not_planned`) its kernel (rules above), fuse `language_model`'s siblings where their
    kernels fuse, route reduced-precision patch convolutions through a kernel; log the plan and return it."""
    owners = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    for module in list(model.modules()):
        if type(module) is torch.nn.Linear:
            give_kernel(module, choose_kernel(module, options, shared=owners[id(module.weight)] > 1))
        elif is_patch_embedding(module) and module.weight.dtype in _REDUCED and options.cpu:
            give_patch_kernel(module, _patch_kernel(module, options))
    if options.cpu and not options.sharded and language_model is not None:
        fuse_siblings(language_model, owners)
    plan = LinearPlan.read(model)
    logger.info("linear plan: {}", plan.summary())
    for name, kernel in plan.kernels.items():
        logger.debug("linear plan: {} -> {}", name, kernel)
    return plan


def choose_kernel(module: torch.nn.Linear, options: PlanOptions, *, shared: bool = False) -> LinearKernel:
    source = PlainWeights((module,))
    quantized = quantized_weight_of(module)
    if quantized is not None:  # the kernel owns it from here
        del module.quantized_weight
        return GroupedInt8Linear(source, quantized, native=options.cpu and options.grouped_int8)
    weight = module.weight
    if not options.cpu or options.sharded or type(weight.data) is not torch.Tensor or weight.device.type != "cpu":
        return TorchLinear(source)
    if (weight.dtype == torch.float16 or not can_pack_weights(weight.dtype)
            or (shared and not options.decode_copy) or weight.dtype not in (torch.bfloat16, torch.float32)):
        return BucketedLinear(source) if weight.dtype in _REDUCED else TorchLinear(source)
    if weight.dtype == torch.bfloat16:
        if options.decode_copy and options.skinny_bf16:
            return OneDnnPackedSkinnyLinear(source, keeps_plain=shared)
        return OneDnnPackedLinear(source, keeps_plain=shared)
    return _float32_kernel(source, options, shared=shared)


def _float32_kernel(source: PlainWeights, options: PlanOptions, *, shared: bool = False) -> LinearKernel:
    if shared:  # one extra copy (the plain weight stays for its other owner), no decode extras on top
        if mkl_serves_float32() and mkl_layout_agrees(*source.shape):
            return MklPackedLinear(source, keeps_plain=True)
        return OneDnnPackedLinear(source, keeps_plain=True)
    if mkl_serves_float32() and mkl_layout_agrees(*source.shape):
        return MklSkinnyLinear(source) if options.decode_copy and options.skinny else MklPackedLinear(source)
    if options.decode_copy and cpu_vendor() != "AuthenticAMD":
        return OneDnnPackedGemvLinear(source)
    return OneDnnPackedLinear(source)


def _patch_kernel(conv: torch.nn.Module, options: PlanOptions) -> LinearKernel:
    """Patch products are packed with padded rows like the linears (the row count is the image's patch count, new
    for almost every image; an unpadded product at a count oneDNN had not met: 4.8 vs 0.5 ms); sharded ranks
    multiply the plain weight. bf16 sums may round differently from the unpadded product (one ulp)."""
    source = PlainWeights((conv,), as_matrix=True)
    if options.sharded or conv.weight.dtype != torch.bfloat16 or not can_pack_weights(torch.bfloat16):
        return TorchLinear(source)
    return OneDnnPackedLinear(source)


def fuse_siblings(language_model: torch.nn.Module, owners: collections.Counter | None = None) -> int:
    """Fuse every q/k/v and gate/up group of `language_model` whose kernels fuse and agree; weights shared with
    another module are left alone. Returns the number of groups."""
    if owners is None:
        owners = collections.Counter(id(p) for m in language_model.modules() for p in m.parameters(recurse=False))
    count = 0
    for module in language_model.modules():
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if not all(isinstance(m, KernelLinear) for m in members):
                continue
            kernels = [m.linear_kernel for m in members]
            if (any(isinstance(k, FusedMember) or not k.fuses() for k in kernels) or not same_inputs(kernels)
                    or any(owners[id(m.weight)] != 1 for m in members) or len({id(m) for m in members}) != len(members)):
                continue
            fuse(members)
            count += 1
    return count


def packed_products(model: torch.nn.Module, row_caps: dict[torch.nn.Module, int] | None = None,
                    ) -> list[tuple[LinearKernel, int | None]]:
    """The packed kernels of `model` that exist so far and build a kernel per row count, one per distinct (in, out,
    dtype, bias or not), with the most rows each meets (`row_caps` modules: the lm-head; None: any)."""
    row_caps = row_caps or {}
    found: dict[tuple, tuple[LinearKernel, int | None]] = {}
    candidates: list[tuple[LinearKernel, int | None]] = []
    for module in model.modules():
        kernel = getattr(module, "linear_kernel", None) or getattr(module, "patch_kernel", None)
        if kernel is not None and not isinstance(kernel, FusedMember):
            candidates.append((kernel, row_caps.get(module)))
    candidates += [(group.kernel, None) for group in fused_groups(model)]
    for kernel, cap in candidates:
        if kernel.pads_rows and kernel.ready:
            key = (kernel.in_features, kernel.out_features, kernel.dtype, kernel.source.has_bias)
            if key not in found or (found[key][1] is not None and (cap is None or cap > found[key][1])):
                found[key] = (kernel, cap)  # a shape shared by a capped and an uncapped module: uncapped
    return list(found.values())


def prime_packed_kernels(model: torch.nn.Module, max_rows: int, *, row_caps: dict[torch.nn.Module, int] | None = None,
                         budget_s: float = PRIME_BUDGET_S, clock: Callable[[], float] = time.perf_counter,
                         ) -> tuple[int, int]:
    """Build, now, oneDNN's kernel for each row bucket up to `max_rows` of every packed product shape.

    oneDNN builds (JIT-compiles) a kernel for each row count a product meets, ~2 ms each here; a serving run
    meets a new bucket in most of its early prefill steps, and warmup's one batch meets only its own. Run at
    warmup, on the model thread, after the warmup batch (which packs the weights it uses). Smallest buckets first,
    while `budget_s` lasts (checked before each bucket). MKL's float32 products build nothing and are skipped, and so
    are the row counts a native product takes (`builds_for`: the bf16 AMX / VDPBF16PS path).
    Returns (products run, largest bucket primed)."""
    from tgi_vlm.layers.linear.kernels import row_bucket, row_buckets

    products = packed_products(model, row_caps)
    start, count, done = clock(), 0, 0
    with torch.inference_mode():
        for rows in row_buckets(max_rows) if products else ():
            if clock() - start > budget_s:
                break
            for kernel, cap in products:
                if (cap is None or rows <= row_bucket(cap)) and kernel.builds_for(rows):
                    kernel(torch.zeros(rows, kernel.in_features, dtype=kernel.dtype))
                    count += 1
            done = rows
    return count, done


__all__ = ["FusedProjections", "LinearPlan", "PlanOptions", "choose_kernel", "fuse_siblings", "packed_products",
           "plan_linears", "prime_packed_kernels"]
