"""benchmarks/peers (tgi-vlm vs vLLM CPU): the workload file carries exactly `tgi-vlm bench`'s requests, a
changed file is refused, and the vLLM runner's closed loop and figures follow `tgi-vlm bench`'s definitions
(driven here by a stand-in engine: vLLM is not installed in the project's environment)."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image
from transformers import AutoProcessor

from tgi_vlm.benchmarking.results import percentiles
from tgi_vlm.benchmarking.synthetic import WorkloadSpec, make_workload
from tgi_vlm.benchmarking.targets.driver import warm_up
from tgi_vlm.router.tokens import TokenCounter
from tgi_vlm.testing import tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))  # as the scripts run

import compare  # noqa: E402
import vllm_runner  # noqa: E402
from export_workload import export_workload  # noqa: E402
from workload_file import PeerRequest, WorkloadError, read_workload  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = str(tiny_model_path("qwen2_vl"))
    return model, export_workload(model, tmp_path_factory.mktemp("workload"), num_requests=3, seed=4)


def test_the_file_holds_bench_requests_laid_out_as_the_adapter_does_with_the_shard_prompt_ids(exported):
    model, written = exported
    workload = read_workload(written.directory)
    assert workload.digest == written.digest and workload.spec == WorkloadSpec(num_requests=3, seed=4).to_dict()
    counter = TokenCounter(model)
    items = make_workload(WorkloadSpec(num_requests=3, seed=4), counter.tokenizer)
    processor = AutoProcessor.from_pretrained(model)
    for i, (request, item) in enumerate(zip(workload.requests, items)):
        image, text = item.params.chunks
        assert request.prompt == "<|vision_start|><|image_pad|><|vision_end|>" + text
        assert [workload.image_bytes(f) for f in request.images] == [image]
        assert [f.size for f in request.images] == item.image_sizes
        assert request.max_new_tokens == item.params.max_new_tokens
        assert request.prompt_token_ids == counter.input_ids(item.params.to_pb(i))
        # what a peer gets from the HF processor on the same prompt and image: the shard's ids
        pil = Image.open(io.BytesIO(image))
        assert processor(text=[request.prompt], images=[pil])["input_ids"][0] == request.prompt_token_ids


def test_the_warm_up_request_is_the_one_tgi_vlm_bench_sends(exported):
    _, workload = exported
    sent = []

    class Router:
        steps, calls = [], {}
        prefix_stats = SimpleNamespace(reset_counters=lambda: None)

        async def submit(self, params):
            sent.append(params)
            return SimpleNamespace(final=lambda: asyncio.sleep(0))

    sizes = [f.size for f in workload.requests[0].images]
    asyncio.run(warm_up(Router(), sizes))
    (params,) = sent
    warm = workload.warmup
    assert params.chunks == [*(workload.image_bytes(f) for f in warm.images), "warm up"]
    assert warm.prompt == "<|vision_start|><|image_pad|><|vision_end|>warm up"
    assert params.max_new_tokens == warm.max_new_tokens == 2


def test_a_changed_image_or_request_is_refused_naming_what_changed(exported, tmp_path):
    _, workload = exported
    copy = tmp_path / "w"
    (copy / "images").mkdir(parents=True)
    for f in workload.directory.rglob("*.*"):
        (copy / f.relative_to(workload.directory)).write_bytes(f.read_bytes())
    image = copy / workload.requests[1].images[0].file
    image.write_bytes(image.read_bytes() + b"\0")
    with pytest.raises(WorkloadError, match=r"request 1: images/r0001-0\.png does not match its sha256"):
        read_workload(copy)
    image.write_bytes(workload.image_bytes(workload.requests[1].images[0]))
    manifest = json.loads((copy / "workload.json").read_text())
    manifest["requests"][2]["max_new_tokens"] += 1
    (copy / "workload.json").write_text(json.dumps(manifest))
    with pytest.raises(WorkloadError, match=f"hash to [0-9a-f]{{16}}, the manifest says {workload.digest}"):
        read_workload(copy)


class StandInEngine:
    """LLMEngine's add_request/step: every step gives each request in flight one token (the id is the
    request's index) and takes `durations[k]` seconds on the shared clock; a request ends at its max."""

    def __init__(self, clock: list[float], durations: list[float]):
        self.clock, self.durations = clock, list(durations)
        self.active: dict[str, dict] = {}
        self.most_in_flight = 0

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.active[request_id] = {"prompt": prompt, "left": max_tokens}
        self.most_in_flight = max(self.most_in_flight, len(self.active))

    def step(self):
        self.clock[0] += self.durations.pop(0)
        outputs = []
        for rid, state in list(self.active.items()):
            state["left"] -= 1
            finished = state["left"] == 0
            outputs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[int(rid)])],
                                           finished=finished, prompt_token_ids=state["prompt"] if finished else None))
            if finished:
                del self.active[rid]
        return outputs


def test_the_closed_loop_keeps_concurrency_in_flight_and_measures_as_bench_does():
    clock = [0.0]
    engine = StandInEngine(clock, durations=[1.0, 2.0, 3.0, 4.0])
    engine_side = [([5, 6], 2), ([7, 0], 1), ([9], 3)]  # (prompt ids vLLM reports, tokens it will produce)
    timings, wall = vllm_runner.run_closed_loop(engine, 3, 2, lambda i: engine_side[i], clock=lambda: clock[0])
    assert engine.most_in_flight == 2 and wall == 10.0
    # request 2 enters when request 1 ends (t=1): submitted 1, tokens at 3, 6, 10
    assert [(t.submitted, t.token_times, t.tokens) for t in timings] == [
        (0.0, [1.0, 3.0], [0, 0]), (0.0, [1.0], [1]), (1.0, [3.0, 6.0, 10.0], [2, 2, 2])]
    assert [t.ttft_s for t in timings] == [1.0, 1.0, 2.0] and [t.itl_s for t in timings] == [[2.0], [], [3.0, 4.0]]

    ours = [PeerRequest("", [], 2, [5, 6]), PeerRequest("", [], 1, [7, 8]), PeerRequest("", [], 4, [9])]
    s = vllm_runner.serving_summary(timings, wall, ours)
    assert s["wrong_output_lengths"] == [2] and s["failed"] == 1  # request 2 wanted 4 tokens, made 3
    assert (s["out_tok_per_s"], s["req_per_s"], s["output_tokens"]) == (0.6, 0.2, 6)
    assert s["ttft_s"] == percentiles([1.0, 1.0, 2.0]) and s["itl_s"] == percentiles([2.0, 3.0, 4.0])
    check = s["prompt_check"]
    assert (check["identical"], check["requests_differing"], check["tgi_vlm_prompt_tokens"],
            check["vllm_prompt_tokens"]) == (False, 1, 5, 5)
    assert check["first_difference"] == {"request": 1, "position": 1, "tgi_vlm_len": 2, "vllm_len": 2,
                                         "tgi_vlm_ids": [7, 8], "vllm_ids": [7, 0]}


def test_compare_plans_each_dtype_per_system_and_pairs_defaults_and_equal_dtypes():
    args = compare.parse_args(["--dtypes", "default", "float32", "--prefix-caching", "both"])
    assert [r.name for r in compare.plan(args)] == [
        "tgi-vlm-default-prefix-on", "vllm-auto-prefix-on", "tgi-vlm-float32-prefix-on", "vllm-float32-prefix-on",
        "tgi-vlm-default-prefix-off", "vllm-auto-prefix-off", "tgi-vlm-float32-prefix-off", "vllm-float32-prefix-off"]
    # --rounds: the list again, vLLM first in each pair of odd rounds, names marked with the round
    rounds = compare.plan(compare.parse_args(["--dtypes", "float32", "--prefix-caching", "default", "--rounds", "3"]))
    assert [r.name for r in rounds] == ["tgi-vlm-float32-prefix-on", "vllm-float32-prefix-on",
                                        "vllm-float32-prefix-on-r1", "tgi-vlm-float32-prefix-on-r1",
                                        "tgi-vlm-float32-prefix-on-r2", "vllm-float32-prefix-on-r2"]
    # vLLM runs at its own default (compiled); --vllm-eager adds an enforce_eager run beside it
    eager = compare.plan(compare.parse_args(["--dtypes", "float32", "--prefix-caching", "default", "--vllm-eager"]))
    assert [(r.name, r.compile) for r in eager] == [("tgi-vlm-float32-prefix-on", False),
                                                    ("vllm-float32-prefix-on", True),
                                                    ("vllm-float32-prefix-on-eager", False)]

    def row(system: str, asked: str, dtype: str, tok_s: float, ttft: float) -> dict:
        serving = {"out_tok_per_s": tok_s, "req_per_s": tok_s / 10, "ttft_s": {"p50": ttft}, "itl_s": {"p50": 0.1}}
        return {"run": {"system": system, "dtype": asked, "prefix_caching": True, "compile": system == "vllm"},
                "name": f"{system}-{asked}", "dtype": dtype, "error": None, "serving": serving}

    eager = row("vllm", "auto", "bfloat16", 250.0, 1.0)
    eager["run"]["compile"], eager["name"] = False, "vllm-auto-eager"  # an extra row: in the table, not a ratio
    rows = [row("tgi-vlm", "default", "float32", 100.0, 2.0), row("tgi-vlm", "bfloat16", "bfloat16", 150.0, 1.0),
            row("vllm", "auto", "bfloat16", 300.0, 1.0), eager, row("vllm", "bfloat16", "bfloat16", 200.0, 0.5)]
    got = [(q["compared"], q["tgi_vlm"], q["vllm"], q["out_tok_per_s"], q["ttft_p50"]) for q in compare.ratios(rows)]
    assert got == [("defaults", "tgi-vlm-default", "vllm-auto", 100 / 300, 2.0),
                   ("both bfloat16", "tgi-vlm-bfloat16", "vllm-bfloat16", 150 / 200, 2.0)]


def test_compare_pairs_runs_within_their_round_and_summarizes_the_median_ratio():
    def row(system: str, asked: str, round_: int, tok_s: float) -> dict:
        serving = {"out_tok_per_s": tok_s, "req_per_s": tok_s / 10, "ttft_s": {"p50": 1.0}, "itl_s": {"p50": 0.1}}
        return {"run": {"system": system, "dtype": asked, "prefix_caching": True, "compile": system == "vllm",
                        "round": round_},
                "name": f"{system}-{asked}-{round_}", "dtype": "float32", "error": None, "serving": serving}

    rows = [row("tgi-vlm", "float32", r, t) for r, t in enumerate((90.0, 120.0, 100.0))]
    rows += [row("vllm", "float32", r, 100.0) for r in range(3)]
    ratios = compare.ratios(rows)
    assert [(q["round"], q["out_tok_per_s"]) for q in ratios] == [(0, 0.9), (1, 1.2), (2, 1.0)]
    [summary] = compare.summary(ratios)
    assert (summary["median"], summary["min"], summary["max"], summary["rounds"]) == (1.0, 0.9, 1.2, 3)


def test_compare_plans_llamacpp_once_a_round_and_pairs_it_at_equal_precision_or_marks_the_quantized_file():
    args = compare.parse_args(["--systems", "tgi-vlm", "llamacpp", "--dtypes", "default", "bfloat16",
                               "--prefix-caching", "default", "--llamacpp-gguf", "bfloat16=/m/g-bf16.gguf",
                               "--llamacpp-gguf", "q4_k_m=/m/g-q4.gguf,-nr -t 2", "--rounds", "2"])
    assert compare.llamacpp_files(args) == {"bfloat16": ("/m/g-bf16.gguf", []), "q4_k_m": ("/m/g-q4.gguf", ["-nr", "-t", "2"])}
    assert [r.name for r in compare.plan(args)] == [
        "tgi-vlm-default-prefix-on", "tgi-vlm-bfloat16-prefix-on", "llamacpp-bfloat16-prefix-off",
        "llamacpp-q4_k_m-prefix-off", "tgi-vlm-default-prefix-on-r1", "tgi-vlm-bfloat16-prefix-on-r1",
        "llamacpp-bfloat16-prefix-off-r1", "llamacpp-q4_k_m-prefix-off-r1"]
    with pytest.raises(SystemExit, match="KEY=FILE"):
        compare.llamacpp_files(compare.parse_args(["--llamacpp-gguf", "/m/no-key.gguf"]))

    def row(system: str, asked: str, dtype: str, tok_s: float) -> dict:
        serving = {"out_tok_per_s": tok_s, "req_per_s": tok_s / 10, "ttft_s": {"p50": 1.0}, "itl_s": {"p50": 0.1}}
        return {"run": {"system": system, "dtype": asked, "prefix_caching": system == "tgi-vlm", "compile": False,
                        "round": 0}, "name": f"{system}-{asked}", "dtype": dtype, "error": None, "serving": serving}

    rows = [row("tgi-vlm", "default", "bfloat16", 30.0), row("tgi-vlm", "float32", "float32", 20.0),
            row("llamacpp", "bfloat16", "bfloat16", 25.0), row("llamacpp", "q4_k_m", "q4_k_m", 40.0),
            row("llamacpp", "float32", "float32", 10.0)]
    got = [(q["compared"], q["tgi_vlm"], q["out_tok_per_s"]) for q in compare.llamacpp_ratios(rows)]
    assert got == [("llama.cpp bfloat16, equal precision (tgi-vlm default)", "tgi-vlm-default", 30 / 25),
                   ("llama.cpp q4_k_m vs tgi-vlm default (bfloat16): not equal precision", "tgi-vlm-default", 30 / 40),
                   ("llama.cpp float32, equal precision", "tgi-vlm-float32", 20 / 10)]
    assert compare.ratios(rows) == []  # no vLLM rows: nothing against vLLM


STUB_SERVER = '''
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
assert sys.argv[sys.argv.index("-np") + 1] == "2" and sys.argv[sys.argv.index("-c") + 1] == "4096"
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["ignore_eos"] and body["temperature"] == 0 and not body["cache_prompt"]
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        n = body["n_predict"] - (1 if body["prompt"][0] == 13 else 0)  # request "13" comes one token short
        sent = 0
        while sent < n:
            k = 2 if n - sent >= 2 and sent % 3 == 1 else 1  # some events carry two tokens
            time.sleep(0.002)
            event = {"content": "x", "tokens": list(range(k)), "stop": False}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n"); self.wfile.flush()
            sent += k
        done = {"content": "", "tokens": [], "stop": True, "tokens_evaluated": len(body["prompt"])}
        self.wfile.write(b"data: " + json.dumps(done).encode() + b"\\n\\n"); self.wfile.flush()
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_the_llamacpp_runner_drives_a_server_in_a_closed_loop_and_checks_every_length(tmp_path):
    """Against a stand-in llama-server (same flags, same streamed events): every request's tokens are counted,
    events carrying two tokens included; a request that comes back one token short is named; the prompt sent is
    the shard's token ids (the server's evaluated count equals theirs)."""
    import llamacpp_runner
    from workload_file import write_workload

    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{STUB_SERVER}")
    server.chmod(0o755)
    requests = [(f"p{i}", [], 5 + i, [13 if i == 2 else 1, 2, 3][: 1 + i % 3]) for i in range(5)]
    workload = write_workload(tmp_path / "w", model="m", model_type="gemma3_text", spec={"concurrency": 2},
                              warmup=("warm up", [], 2), requests=requests)
    out = tmp_path / "out.json"
    llamacpp_runner.main([str(workload.directory), "--server", str(server), "--gguf", "m.gguf", "--json", str(out)])
    report = json.loads(out.read_text())
    s = report["serving"]
    assert report["workload_digest"] == workload.digest and s["failed"] == 0
    assert s["wrong_output_lengths"] == [2] and s["prompt_tokens_differ"] == []
    assert s["output_tokens"] == sum(5 + i for i in range(5)) - 1
    assert s["ttft_s"]["p50"] > 0 and s["itl_s"]["p50"] >= 0 and s["out_tok_per_s"] == s["output_tokens"] / s["wall_s"]
