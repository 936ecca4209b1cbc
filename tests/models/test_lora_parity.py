"""Multi-LoRA serving against transformers: one batch mixing three random peft adapters and the base model gives,
per request, the greedy tokens (and float32 logits within 1e-4) of transformers' generate on the base model with
that request's adapter merged (`merge_and_unload`), through chunked prefill across an image, a join mid-decode, the
fused and lean CPU layers and the CUDA-graph stand-in; seeded sampling draws what TGI's exponential race over the
merged model's logits draws. Adapters are made offline by peft (tests/models/lora_reference.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from tests.conftest import load_engine
from tests.models.lora_reference import RECIPES, make_adapter, merged_model
from tests.models.reference import Reference, assert_matches, hf_greedy
from tests.models.vlm_reference import hf_inputs
from tgi_vlm.layers.linear.fused import fused_groups
from tgi_vlm.lora import AdapterSpec
from tgi_vlm.models.cuda_graphs import DecodeGraphs
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import make_request

IMG = png_bytes(make_test_image(37, 53, seed=2))
TEXT_PROMPTS = ("hello world this is", "the quick brown fox jumps over the lazy dog and then", "numbers 1 2 3 and 4")
IMAGE_PROMPTS = (("Look at ", IMG, " and describe it"), ("just some text without any picture at all",),
                 ("First ", IMG, " then compare them"))
N = 6


@pytest.fixture(scope="module", params=["llama", "qwen2_vl", "gemma3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def adapter_dirs(arch, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    return {name: make_adapter(arch, root / name, recipe) for name, recipe in RECIPES.items()}


@pytest.fixture(scope="module")
def engine(arch, adapter_dirs):
    return load_engine(arch, lora_adapters=tuple(AdapterSpec(n, str(p)) for n, p in adapter_dirs.items()))


@pytest.fixture(scope="module")
def references(arch, adapter_dirs, engine):
    """(adapter name or "", prompt index) -> transformers' greedy run on the merged model; computed on demand."""
    models, cache = {}, {}

    def reference(adapter: str, prompt: tuple, forced: list[int] | None = None) -> Reference:
        key = (adapter, prompt, tuple(forced or ()))
        if key not in cache:
            if adapter not in models:
                models[adapter] = merged_model(arch, adapter_dirs[adapter] if adapter else None)
            cache[key] = hf_greedy(models[adapter], inputs(arch, engine, prompt), N, forced)
        return cache[key]

    return reference


def inputs(arch: str, engine, prompt: tuple) -> dict:
    if arch == "llama":
        ids = engine.tokenize_request(make_request(0, *prompt)).ids
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    return hf_inputs(arch, prompt)


def prompts(arch: str) -> list[tuple]:
    return [(p,) for p in TEXT_PROMPTS] if arch == "llama" else list(IMAGE_PROMPTS)


def adapted(request, adapter: str):
    if adapter:
        request.adapter_id = adapter
    return request


@pytest.fixture
def graphed(engine):
    """The engine replaying decode steps through eager graph stand-ins for this test only (conftest's `runner`
    checks the leaks)."""
    engine.graphs = DecodeGraphs.eager(engine, (8,), max_kv_len=128)
    yield engine
    engine.graphs = None


def test_the_cpu_plan_fuses_and_leans_the_adapted_layers_so_the_parity_below_covers_those_paths(engine):
    adapted_layers = [m for m in engine.language_model.modules() if getattr(m, "extra", None) is not None]
    assert adapted_layers and fused_groups(engine.language_model)
    assert any(type(layer).__name__.startswith("Lean") for layer in engine.language_model.modules())
    assert engine.info().lora_adapters == list(RECIPES)


def test_a_mixed_batch_of_three_adapters_and_the_base_model_matches_each_merged_model(arch, engine, runner, references):
    """Chunked prefill (3 tokens a step, fewer than an image's span) and two requests joining mid-decode."""
    first, text, second = prompts(arch)
    plan = [(0, "", first), (1, "lora-all", first), (2, "lora-qv", first), (3, "lora-rs", second), (4, "", text)]
    span = engine.tokenize_request(make_request(0, *first)).media
    assert arch == "llama" or span[0].length > 3
    engine.prefill_budget = 3
    runner.prefill([adapted(make_request(rid, *p, max_new_tokens=N, chunk_len=3), a) for rid, a, p in plan[:2]])
    while any(s.prefilling for s in runner.batch.seqs):  # through the prompts in 3-token chunks
        runner.step()
    runner.step()  # and one decode step before the others join
    engine.prefill_budget = 4096
    runner.prefill([adapted(make_request(rid, *p, max_new_tokens=N), a) for rid, a, p in plan[2:]], batch_id=2)
    runner.run()
    for rid, adapter, prompt in plan:
        assert_matches(runner, rid, references(adapter, prompt))
    base = references("", first).logits[0]
    for adapter in ("lora-all", "lora-qv"):  # each adapter moves the logits far past the tolerance
        assert (references(adapter, first).logits[0] - base).abs().max() > 0.05


def test_decode_steps_replayed_through_a_graph_read_the_adapter_of_each_row(arch, graphed, runner, references):
    plan = [(0, "lora-rs"), (1, ""), (2, "lora-all"), (3, "lora-qv"), (4, "lora-all")]
    chosen = prompts(arch)
    runner.prefill([adapted(make_request(rid, *chosen[rid % 3], max_new_tokens=N), a) for rid, a in plan])
    runner.run()
    for rid, adapter in plan:
        assert_matches(runner, rid, references(adapter, chosen[rid % 3]))


def test_seeded_sampling_under_an_adapter_is_tgis_race_over_the_merged_models_logits(arch, engine, runner, references):
    prompt, seed = prompts(arch)[0], 77
    runner.prefill([adapted(make_request(1, *prompt, max_new_tokens=N, temperature=0.9, top_k=20, seed=seed),
                            "lora-all")])
    runner.run()
    got = runner.tokens[1]
    along = references("lora-all", prompt, forced=got)  # the merged model's raw logits along our tokens
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(20)])
    rng = torch.Generator().manual_seed(seed)
    expected = []
    for logits in along.logits:
        probs = torch.softmax(warpers(torch.tensor([[0]]), logits[None])[0], -1)
        expected.append(int((probs / torch.empty_like(probs).exponential_(1, generator=rng)).argmax()))
    assert got == expected
    assert got != references("lora-all", prompt).ids  # it did sample
