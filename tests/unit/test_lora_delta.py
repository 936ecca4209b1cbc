"""`LoraDelta.add_to`: every row gets exactly its own adapter's `x A^T (scale B)^T` (the base model's rows nothing),
whichever path the step takes — slices for a few runs, batched products over padded groups (adapters gathered or
sliced), the masked product inside a graphed context — and into a column block of a fused product in place."""

from __future__ import annotations

import pytest
import torch

from tgi_vlm.layers.step_context import StepContext, using
from tgi_vlm.lora.delta import LoraDelta

IN, OUT, N = 24, 20, 5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def delta():
    """Adapters 1, 2, 4, 5 target the layer with ranks 4, 2, 4, 3; adapter 3 does not (the pairs in float64)."""
    g = torch.Generator().manual_seed(0)
    pairs = {i: (torch.randn(r, IN, generator=g, dtype=torch.float64), torch.randn(OUT, r, generator=g,
                                                                                dtype=torch.float64))
             for i, r in ((1, 4), (2, 2), (4, 4), (5, 3))}
    return LoraDelta.from_pairs({i: (a.float(), b.float()) for i, (a, b) in pairs.items()}, N), pairs


def expected(x: torch.Tensor, base: torch.Tensor, ctx: StepContext, pairs) -> torch.Tensor:
    """In float64 (the layer computes its delta in float32: compared within float32 rounding)."""
    x, out = x.double(), base.double()
    for seq, adapter in enumerate(ctx.adapters):
        rows = slice(ctx.row_starts[seq], ctx.row_starts[seq + 1])
        if adapter in pairs:
            a, b = pairs[adapter]
            out[rows] += x[rows] @ a.T @ b.T
    return out.to(base.dtype)


CONTEXTS = {  # (sequence lengths, adapters)
    "two runs: slices": ([3, 2, 4], [1, 0, 4]),
    "consecutive adapters, padded groups": ([3, 1, 2, 1, 1, 2], [1, 2, 0, 1, 2, 0]),
    "many rows of consecutive adapters: padded groups": ([40, 30, 20, 3], [1, 2, 1, 0]),
    "gathered adapters with one that does not target the layer": ([1, 1, 1, 1, 1, 1, 1], [5, 0, 1, 3, 5, 4, 1]),
    "base only": ([2, 3], [0, 0]),
}


def context(lengths, adapters) -> StepContext:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return StepContext(tuple(range(len(lengths))), tuple(starts), tuple(adapters), CPU)


@pytest.mark.parametrize("case", CONTEXTS)
def test_each_row_gets_its_own_adapters_delta_in_every_eager_path(delta, case):
    layer, pairs = delta
    ctx = context(*CONTEXTS[case])
    x = torch.randn(1, ctx.num_rows, IN, generator=torch.Generator().manual_seed(1))
    base = torch.randn(1, ctx.num_rows, OUT)
    out = base.clone()
    with using(ctx):
        layer.add_to(x, out)
    torch.testing.assert_close(out[0], expected(x[0], base[0], ctx, pairs), rtol=1e-5, atol=1e-5)


def test_the_cases_reach_every_eager_path(delta, monkeypatch):
    layer, _ = delta
    taken = []
    monkeypatch.setattr(LoraDelta, "_add_masked", lambda self, *args: taken.append("masked"))
    monkeypatch.setattr(LoraDelta, "_add_grouped", lambda self, rows, target, groups: taken.append(
        ("grouped", groups.span is not None, groups.padding is not None)))
    paths = {}
    for case, (lengths, adapters) in CONTEXTS.items():
        ctx, before = context(lengths, adapters), len(taken)
        with using(ctx):
            layer.add_to(torch.zeros(ctx.num_rows, IN), torch.zeros(ctx.num_rows, OUT))
        paths[case] = taken[-1] if len(taken) > before else "sliced" if ctx.adapter_runs else "none"
    assert list(paths.values()) == ["sliced", ("grouped", True, True), ("grouped", True, True), ("grouped", False, True),
                                    "none"]


def test_a_graphed_context_adds_by_the_static_adapter_buffer(delta):
    layer, pairs = delta
    ctx = StepContext.for_graph(8, CPU)
    ctx.static_adapters.copy_(torch.tensor([2, 0, 5, 3, 1, 1, 4, 0]))
    plain = context([1] * 8, ctx.static_adapters.tolist())
    x = torch.randn(8, IN)
    base = torch.randn(8, OUT)
    out = base.clone()
    with using(ctx):
        layer.add_to(x, out)
    torch.testing.assert_close(out, expected(x, base, plain, pairs), rtol=1e-5, atol=1e-5)


def test_the_delta_lands_in_place_in_a_column_block_of_a_fused_product(delta):
    layer, pairs = delta
    ctx = context([2, 3, 1, 2], [1, 4, 0, 2])
    x = torch.randn(1, 8, IN)
    fused = torch.zeros(1, 8, 7 + OUT + 5)
    with using(ctx):
        layer.add_to(x, fused[..., 7 : 7 + OUT])
    torch.testing.assert_close(fused[0, :, 7 : 7 + OUT], expected(x[0], torch.zeros(8, OUT), ctx,
                                                                  pairs), rtol=1e-5, atol=1e-5)
    assert not fused[..., :7].any() and not fused[..., 7 + OUT :].any()


def test_outside_a_step_nothing_is_added_and_a_partial_row_set_is_refused(delta):
    layer, _ = delta
    out = torch.zeros(3, OUT)
    layer.add_to(torch.ones(3, IN), out)  # no step context: plain transformers, the vision tower
    assert not out.any()
    with using(context([2, 2], [1, 2])), pytest.raises(RuntimeError, match="got 3 rows in a step of 4"):
        layer.add_to(torch.ones(3, IN), out)


@pytest.mark.parametrize("case", ["two runs: slices", "consecutive adapters, padded groups",
                                  "gathered adapters with one that does not target the layer"])
def test_a_bfloat16_layer_gets_the_float32_delta_rounded_once(delta, case):
    layer, pairs = delta
    ctx = context(*CONTEXTS[case])
    x = torch.randn(1, ctx.num_rows, IN, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = torch.zeros(1, ctx.num_rows, OUT, dtype=torch.bfloat16)
    with using(ctx):
        layer.add_to(x, out)
    want = expected(x[0], torch.zeros(ctx.num_rows, OUT), ctx, pairs)  # float32 sums of the bf16 inputs
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[0], want.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CONTEXTS) + ["graphed"])
def test_a_fused_groups_one_term_equals_its_members_terms_in_their_column_blocks(case):
    """q/k/v-like: members of widths 12, 6, 6 with ranks 4, none, 2 (as an adapter targeting q and v only)."""
    g = torch.Generator().manual_seed(3)
    widths = [12, 6, 6]
    members = [LoraDelta.from_pairs({i: (torch.randn(4, IN, generator=g), torch.randn(12, 4, generator=g))
                                     for i in (1, 2, 4)}, N), None,
               LoraDelta.from_pairs({i: (torch.randn(2, IN, generator=g), torch.randn(6, 2, generator=g))
                                     for i in (2, 5)}, N)]
    fused = LoraDelta.fused(members, widths)
    if case == "graphed":
        ctx = StepContext.for_graph(8, CPU)
        ctx.static_adapters.copy_(torch.tensor([2, 0, 5, 3, 1, 1, 4, 0]))
    else:
        ctx = context(*CONTEXTS[case])
    x = torch.randn(1, ctx.num_rows, IN, generator=g)
    got, want = torch.zeros(1, ctx.num_rows, 24), torch.zeros(1, ctx.num_rows, 24)
    with using(ctx):
        fused.add_to(x, got)
        for member, start, width in zip(members, (0, 12, 18), widths):
            if member is not None:
                member.add_to(x, want[..., start : start + width])
    assert fused.adapters == (1, 2, 4, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got[..., 12:18].any()  # the member without a term
