"""The prefix-caching benchmark's workload and report (no shard): conversations resend their history,
and the report compares the right requests."""

from __future__ import annotations

from transformers import AutoTokenizer

from tgi_vlm.benchmarking.prefix_report import compare, markdown
from tgi_vlm.benchmarking.results import RequestResult, ServingResult
from tgi_vlm.benchmarking.synthetic import ConversationSpec, make_conversations
from tgi_vlm.testing import tiny_model_path


def test_conversations_are_deterministic_share_one_system_prompt_and_resend_the_history():
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl"))
    spec = ConversationSpec(conversations=3, turns=4, seed=5)
    first, again = make_conversations(spec, tokenizer), make_conversations(spec, tokenizer)
    assert [(c.opening, c.questions, c.max_new_tokens) for c in first] == \
           [(c.opening, c.questions, c.max_new_tokens) for c in again]
    assert len({c.opening[0] for c in first}) == 1  # the system prompt
    for c in first:
        assert 1 <= len(c.image_sizes) <= 2 and len(c.opening) == 1 + len(c.image_sizes)
        assert all(isinstance(image, bytes) for image in c.opening[1:])
        assert len(c.questions) == len(c.max_new_tokens) == 4 and all(16 <= n <= 32 for n in c.max_new_tokens)
    c = first[0]
    params = c.turn([*c.opening, c.questions[0], "an answer"], 1)
    assert params.chunks == [*c.opening, c.questions[0], "an answer", c.questions[1]]
    assert params.max_new_tokens == c.max_new_tokens[1] and params.ignore_eos


def run(wall: float, ttfts: list[float], outputs: list[list[int]], cached: int, shard_cpu: float) -> ServingResult:
    requests = [RequestResult(tokens, 0.0, [t + i for i in range(len(tokens))], turn=turn)
                for turn, (t, tokens) in enumerate(zip(ttfts, outputs))]
    prefix = {"prompt_tokens": 1000, "cached_tokens": cached, "hit_rate": cached / 1000, "hits": int(cached > 0),
              "blocks_cached": 7, "evictions": 0, "refused_claims": 0}
    return ServingResult(wall, requests, [], {}, {}, prefix, {"shard": shard_cpu, "router": 1.0})


def test_the_report_compares_ttft_of_later_turns_throughput_and_identical_outputs():
    off = run(10.0, [4.0, 3.0, 5.0], [[1, 2], [3, 4], [5, 6]], 0, 8.0)
    on = run(5.0, [4.0, 1.0, 0.5], [[1, 2], [3, 4], [5, 7]], 600, 4.0)
    report = compare("multiturn", ConversationSpec(), {"off": off, "on": on}, "/somewhere/qwen2_vl-bench",
                     {"cores": 2, "torch_threads": 2, "load_avg_1m": 0.5, "date": "today"})
    assert report["model"] == "qwen2_vl-bench"
    assert report["off"]["ttft_later_turns_s"]["p50"] == 4.0 and report["on"]["ttft_later_turns_s"]["p50"] == 0.75
    assert report["ttft_p50_on_over_off"] == 0.75 / 4.0
    assert report["throughput_on_over_off"] == 2.0 and report["shard_cpu_on_over_off"] == 0.5
    assert report["on"]["prefill_tokens_computed"] == 400 and report["outputs_identical"] == 2
    table = markdown(report)
    assert "| TTFT turns ≥ 2, p50 (s) | 4.000 | 0.750 | 0.19 | ≤ 0.3 |" in table
    assert "| prompt tokens computed by the shard | 1000 | 400 | 0.40 |  |" in table
    assert "Outputs identical in both modes (greedy): 2/3." in table
