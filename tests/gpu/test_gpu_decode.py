"""On a CUDA device: CUDA-graph decode gives the tokens of eager decode and of transformers' generate,
and the flashinfer backend agrees with the torch reference. Run with `pytest -m gpu tests/gpu`
(`make gpu-check`); skipped without CUDA, and the flashinfer cases without flashinfer."""

from __future__ import annotations

import pytest
import torch

from tgi_vlm.config import DEFAULT_CUDA_GRAPHS, EngineConfig
from tgi_vlm.layers.attention import flashinfer_available, make_backend
from tgi_vlm.models.cuda_graphs import DecodeGraphs, graph_max_kv_len
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import Runner, make_request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed")

IMG = png_bytes(make_test_image(20, 20, seed=1))
PROMPTS = [("Look at ", IMG, " and describe it"), ("just text, no picture",), (IMG, " what is this"),
           ("one more request to fill the batch",), ("five",)]
MAX_NEW = 8
KV_BLOCKS = 1024


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 must be float32 on the GPU too: cuDNN's default TF32 convolutions (the Qwen2-VL and SigLIP
    patch embeddings) would make the vision features differ from transformers' CPU reference."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _load(arch: str, *, size: str, attention: str, dtype: str):
    from tgi_vlm.models import get_model

    config = EngineConfig(device="cuda", attention=attention, dtype=dtype, cuda_graphs=DEFAULT_CUDA_GRAPHS)
    model = get_model(str(tiny_model_path(arch, size=size)), config)
    model.allocate_kv_cache(KV_BLOCKS)  # not sized from free memory: the tests share the GPU
    return model


def _generate(model, prompts=PROMPTS):
    runner = Runner(model)
    runner.prefill([make_request(i, *p, max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)])
    runner.run()
    assert model.kv_blocks_in_use == 0
    return dict(runner.tokens), dict(runner.logits)


def _with_graphs(model, eager_first: bool = True):
    if eager_first:  # flashinfer learns its plan keys from one eager run, as warmup provides in serving
        _generate(model, PROMPTS[:1])
    model.graphs = DecodeGraphs.capture(model, DEFAULT_CUDA_GRAPHS, graph_max_kv_len(512, model.kv_cache))
    return model.graphs


class _Counting:
    def __init__(self, graphs):
        self.graphs, self.replays = graphs, []

    def plan(self, meta):
        return self.graphs.plan(meta)

    def replay(self, plan, *args):
        self.replays.append(plan.size)
        return self.graphs.replay(plan, *args)


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3"])
def test_graph_decode_gives_the_eager_tokens_and_transformers_tokens(arch):
    from tests.models.vlm_reference import hf_reference

    model = _load(arch, size="tiny", attention="torch", dtype="float32")
    assert model.attention.name == "torch"
    eager, _ = _generate(model)
    counting = _Counting(_with_graphs(model))
    model.graphs = counting
    graphed, _ = _generate(model)
    assert graphed == eager
    assert counting.replays == [8] * (MAX_NEW - 1)  # 5 sequences padded to 8 at every decode step
    for rid, prompt in enumerate(PROMPTS[:2]):
        assert graphed[rid] == hf_reference(arch, prompt, MAX_NEW).ids, f"request {rid} differs from transformers"


@needs_flashinfer
@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3"])
def test_flashinfer_graph_decode_gives_the_flashinfer_eager_tokens(arch):
    model = _load(arch, size="bench", attention="flashinfer", dtype="bfloat16")  # head_dim 64
    assert model.attention.name == "flashinfer"
    eager, _ = _generate(model)
    model.graphs = _with_graphs(model)
    graphed, _ = _generate(model)
    model.graphs = None
    assert graphed == eager


@needs_flashinfer
@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3"])
def test_flashinfer_and_torch_logits_agree_in_bf16(arch):
    model = _load(arch, size="bench", attention="flashinfer", dtype="bfloat16")
    flashinfer = model.attention
    model.attention = make_backend("torch", flashinfer.pattern)  # the backend is the model's own object
    ref_tokens, ref_logits = _generate(model)
    model.attention = flashinfer
    tokens, logits = _generate(model)
    for rid in ref_tokens:
        same = next((i for i, (a, b) in enumerate(zip(tokens[rid], ref_tokens[rid])) if a != b), len(tokens[rid]))
        for step in range(same + 1 if same < len(tokens[rid]) else same):
            a, b = logits[rid][step].float(), ref_logits[rid][step].float()
            tol = 0.02 * b.abs().max().item() + 0.05
            assert (a - b).abs().max().item() <= tol, f"request {rid} step {step}"
        if same < len(tokens[rid]):
            # bf16 logits tie often (one ulp is 1/32 at magnitude 4-8): a different greedy token is fine only
            # when torch's own logits rate it (near-)equal to torch's choice.
            b = ref_logits[rid][same].float()
            gap = (b.max() - b[tokens[rid][same]]).item()
            assert gap <= 0.02 * b.abs().max().item() + 0.05, (
                f"request {rid} step {same}: {tokens[rid]} vs torch {ref_tokens[rid]} (torch logit gap {gap:.3f})")
