"""On a CUDA device: CUDA-graph decode gives the tokens of eager decode and of transformers' generate,
and the flashinfer backend agrees with the torch reference, also where a sliding window is shorter
than the prompts (mistral). Run with `pytest -m gpu tests/gpu` (`make gpu-check`); skipped without
CUDA, and the flashinfer cases without flashinfer."""

from __future__ import annotations

import inspect
import json

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


def _load(arch: str, *, size: str, attention: str, dtype: str, path=None):
    from tgi_vlm.models import get_model

    config = EngineConfig(device="cuda", attention=attention, dtype=dtype, cuda_graphs=DEFAULT_CUDA_GRAPHS)
    model = get_model(str(path or tiny_model_path(arch, size=size)), config)
    model.allocate_kv_cache(KV_BLOCKS)  # not sized from free memory: the tests share the GPU
    return model


def _generate(model, prompts=PROMPTS):
    runner = Runner(model)
    runner.prefill([make_request(i, *p, max_new_tokens=MAX_NEW) for i, p in enumerate(prompts)])
    runner.run()
    assert model.kv_blocks_in_use == 0
    return dict(runner.tokens), dict(runner.logits)


def _with_graphs(model, eager_first: bool = True, prompts=PROMPTS):
    if eager_first:  # flashinfer learns its plan keys from one eager run, as warmup provides in serving
        _generate(model, prompts[:1])
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
    _assert_bf16_agree(tokens, logits, ref_tokens, ref_logits)


def _assert_bf16_agree(tokens, logits, ref_tokens, ref_logits) -> None:
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


# ----- a sliding window shorter than the prompts (mistral: every layer slides) -----
TEXT_PROMPTS = [("the quick brown fox jumps over the lazy dog and then some more words follow here " * 3,),
                ("hello world this is",), ("numbers 1 2 3 and 4 and 5 and 6 and 7 and 8 and 9",), ("five",)]
BENCH_WINDOW = 16  # the bench recipe's window (1024) never masks these prompts


def _assert_window_masks(model, window: int) -> None:
    assert model.text_config.sliding_window == window
    assert len(model.tokenizer(TEXT_PROMPTS[0][0])["input_ids"]) > 2 * window


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    """The bench mistral (head_dim 64, a size flashinfer compiles) with sliding_window 16; weights linked."""
    source = tiny_model_path("mistral", size="bench")
    target = tmp_path_factory.mktemp("mistral-window")
    for item in source.iterdir():
        (target / item.name).symlink_to(item)
    (target / "config.json").unlink()
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "sliding_window": BENCH_WINDOW}))
    return target


def test_graph_decode_with_a_window_shorter_than_the_prompts_gives_the_eager_tokens():
    model = _load("mistral", size="tiny", attention="torch", dtype="float32")  # window 8
    _assert_window_masks(model, 8)
    eager, _ = _generate(model, TEXT_PROMPTS)
    counting = _Counting(_with_graphs(model, prompts=TEXT_PROMPTS))
    model.graphs = counting
    graphed, _ = _generate(model, TEXT_PROMPTS)
    assert graphed == eager
    assert counting.replays == [4] * (MAX_NEW - 1)


@needs_flashinfer
def test_flashinfer_with_a_window_shorter_than_the_prompts_agrees_with_torch_and_its_graphs(windowed_mistral):
    model = _load("mistral", size="bench", attention="flashinfer", dtype="bfloat16", path=windowed_mistral)
    _assert_window_masks(model, BENCH_WINDOW)
    flashinfer = model.attention
    model.attention = make_backend("torch", flashinfer.pattern)
    ref_tokens, ref_logits = _generate(model, TEXT_PROMPTS)
    model.attention = flashinfer
    tokens, logits = _generate(model, TEXT_PROMPTS)
    _assert_bf16_agree(tokens, logits, ref_tokens, ref_logits)
    model.graphs = _with_graphs(model, prompts=TEXT_PROMPTS)
    graphed, _ = _generate(model, TEXT_PROMPTS)
    model.graphs = None
    assert graphed == tokens


# ----- the CPU fake (tests/fakes/flashinfer.py) against the installed flashinfer -----
WORKSPACE = "workspace"
BACKEND_CALLS = [  # (class, method, positional args after self, keyword args) as flashinfer_backend.py calls them
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__", (WORKSPACE, "NHD"), {}),
    ("BatchPrefillWithPagedKVCacheWrapper", "plan", ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len",
                                                     4, 2, 64, 16),
     dict(custom_mask=None, causal=True, window_left=-1, sm_scale=0.125, q_data_type=torch.bfloat16,
          kv_data_type=torch.bfloat16)),
    ("BatchPrefillWithPagedKVCacheWrapper", "run", ("q", "cache"), {}),
    ("BatchDecodeWithPagedKVCacheWrapper", "__init__", (WORKSPACE, "NHD"),
     dict(use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
          paged_kv_last_page_len_buffer=None)),
    ("BatchDecodeWithPagedKVCacheWrapper", "plan", ("kv_indptr", "kv_indices", "last_page_len", 4, 2, 64, 16),
     dict(window_left=-1, sm_scale=0.125, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)),
    ("BatchDecodeWithPagedKVCacheWrapper", "run", ("q", "cache"), {}),
]


@needs_flashinfer
@pytest.mark.parametrize(("cls", "method", "args", "kwargs"), BACKEND_CALLS,
                         ids=[f"{c[:10]}.{m}" for c, m, _, _ in BACKEND_CALLS])
def test_the_backends_calls_bind_to_the_installed_flashinfer_as_to_the_fake(cls, method, args, kwargs):
    import flashinfer

    from tests.fakes import flashinfer as fake

    for module in (flashinfer, fake):
        function = getattr(getattr(module, cls), method)
        inspect.signature(function).bind("self", *args, **kwargs)  # TypeError when the call does not fit
        inner = getattr(getattr(module, cls), "_plan_impl", None)  # decode plan's keyword-only half (0.7.x)
        if method == "plan" and inner is not None:
            inspect.signature(inner).bind("self", *args, **kwargs)
