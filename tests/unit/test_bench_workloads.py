"""`tgi-vlm bench` dispatches through registries (no shard here): names resolve or list the known ones, the
target follows --url unless named, the loops send requests as the workload says, and a workload or a target
added by registering it runs end to end with the report `benchmarks/peers` reads."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest

from tgi_vlm.benchmarking import targets, workloads
from tgi_vlm.benchmarking.load import Chats, Requests
from tgi_vlm.benchmarking.options import BenchError, BenchOptions, WorkloadOptions
from tgi_vlm.benchmarking.results import RequestResult, ServingResult
from tgi_vlm.benchmarking.run import run_bench
from tgi_vlm.benchmarking.synthetic import Conversation, ConversationSpec, WorkItem, WorkloadSpec
from tgi_vlm.benchmarking.targets.base import Session, Target
from tgi_vlm.benchmarking.targets.driver import DriverTarget
from tgi_vlm.benchmarking.targets.http import HttpTarget
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.testing import tiny_model_path

NO_EOS = WorkloadOptions(ignore_eos=False)


def test_an_unknown_workload_or_target_lists_the_known_ones():
    with pytest.raises(BenchError) as workload:
        workloads.workload_named("audio")
    assert str(workload.value) == "unknown --workload 'audio'; known: synthetic, multiturn, shared-prefix, video"
    with pytest.raises(BenchError) as target:
        targets.target_for(BenchOptions("m", target="llamacpp"))
    assert str(target.value) == "unknown --target 'llamacpp'; known: driver, http"


def test_the_video_workload_sends_one_clip_per_request_the_same_every_run_and_http_writes_it_as_markdown():
    from tgi_vlm.benchmarking.targets.http import request_body
    from tgi_vlm.media import VideoBytes
    from tgi_vlm.router.tokens import TokenCounter

    tokenizer = TokenCounter(str(tiny_model_path("qwen2_vl"))).tokenizer
    options = WorkloadOptions(num_requests=3, image_min=32, image_max=64, output_min=2, output_max=4)
    first, again = (workloads.workload_named("video").build(options, tokenizer) for _ in range(2))
    clips = [[c for c in item.params.chunks if isinstance(c, VideoBytes)] for item in first.items]
    assert [len(c) for c in clips] == [1, 1, 1] and [i.params for i in first.items] == [i.params for i in again.items]
    assert request_body(first.items[0].params)["inputs"].startswith("![video](data:video/mp4;base64,")


def test_the_target_is_the_driver_unless_a_url_is_given_or_a_target_named():
    assert type(targets.target_for(BenchOptions("m"))) is DriverTarget
    http = targets.target_for(BenchOptions("m", url="http://host:3000/", load=NO_EOS))
    assert (type(http), http.url, http.transport, http.num_shard) == (HttpTarget, "http://host:3000", "HTTP http://host:3000",
                                                                      None)
    with pytest.raises(BenchError, match=r"^--target http: give the server's --url$"):
        targets.target_for(BenchOptions("m", target="http", load=NO_EOS))


def test_http_refuses_ignore_eos_which_tgis_api_does_not_have():
    with pytest.raises(BenchError, match=r"^--url: TGI's HTTP API has no ignore_eos; add --no-ignore-eos"):
        targets.target_for(BenchOptions("m", url="http://host:3000"))


def test_the_prefix_comparison_runs_only_on_a_target_that_switches_the_prefix_cache():
    from tgi_vlm.benchmarking.comparisons import COMPARISONS

    multiturn = workloads.workload_named("multiturn")
    COMPARISONS[multiturn.comparison].check(multiturn, DriverTarget("m"))
    with pytest.raises(BenchError, match=r"^--workload multiturn compares the router driver's prefix cache off and on"):
        COMPARISONS[multiturn.comparison].check(multiturn, HttpTarget("http://host"))


def item(n: int, arrival_s: float = 0.0) -> WorkItem:
    return WorkItem(RequestParams([f"request {n}"], max_new_tokens=n + 1), prompt_tokens=2, arrival_s=arrival_s)


def test_the_closed_loop_keeps_concurrency_in_flight_and_returns_results_in_workload_order():
    in_flight, most = [0], [0]

    async def submit(params: RequestParams) -> RequestResult:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.01 * (3 - params.max_new_tokens % 3))  # finish out of order
        in_flight[0] -= 1
        return RequestResult([params.max_new_tokens], 0.0, [0.1])

    load = Requests(WorkloadSpec(num_requests=5, concurrency=2), [item(n) for n in range(5)])
    results = asyncio.run(load.drive(submit, start=0.0))
    assert most[0] == 2 and [r.tokens for r in results] == [[1], [2], [3], [4], [5]]


def test_a_conversation_resends_each_answer_with_its_next_question():
    sent = []

    async def submit(params: RequestParams) -> RequestResult:
        sent.append(params.chunks)
        return RequestResult([1], 0.0, [0.1], text=f"answer {len(sent)}")

    chat = Conversation(["system", b"png"], ["Q1", "Q2"], [3, 4])
    results = asyncio.run(Chats(ConversationSpec(conversations=1, turns=2), [chat]).drive(submit, start=0.0))
    assert sent == [["system", b"png", "Q1"], ["system", b"png", "Q1", "answer 1", "Q2"]]
    assert [r.turn for r in results] == [0, 1]


# ----- one registration each: a workload and a target ----------------------------------------------

@dataclass
class EchoTarget(Target):
    """Answers every request with its own max_new_tokens tokens, at fixed times after it was handed over."""

    name = "echo"
    sessions: int = 0

    @classmethod
    def from_options(cls, options: BenchOptions) -> EchoTarget:
        return cls()

    @property
    def transport(self) -> str:
        return "echo"

    @asynccontextmanager
    async def session(self, *, prefix_caching=None, profile_to=None):
        self.sessions += 1
        yield EchoSession()


class EchoSession(Session):
    warmed = False

    async def warm_up(self, load) -> None:
        EchoSession.warmed = True

    async def submit(self, params: RequestParams) -> RequestResult:
        n = params.max_new_tokens
        return RequestResult(list(range(n)), 1.0, [1.0 + 0.5 * (k + 1) for k in range(n)])

    def end(self, wall_s: float, results: list[RequestResult]) -> ServingResult:
        return ServingResult(2.0, results, [], {})  # a fixed wall time: the rates below are exact


def test_a_registered_workload_runs_on_a_registered_target_and_reports_what_peers_read(monkeypatch, tmp_path):
    spec = WorkloadSpec(num_requests=2, concurrency=2)
    two = workloads.Workload("two", "two fixed requests", "reference", lambda o, tokenizer: Requests(spec, [item(1), item(3)]))
    monkeypatch.setitem(workloads.WORKLOADS, "two", two)
    monkeypatch.setitem(targets.TARGETS, "echo", EchoTarget)
    options = BenchOptions(str(tiny_model_path("qwen2_vl")), workload="two", target="echo", hf=False, out_dir=tmp_path,
                           load=WorkloadOptions(num_requests=2, concurrency=2))
    outcome = run_bench(options)
    assert EchoSession.warmed and outcome.written[0].name == "serving-qwen2_vl-tiny-n2-c2-echo.json"  # (+ a PNG)
    report = json.loads(outcome.written[0].read_text())
    assert sorted(report) == ["dtype", "model", "num_shard", "output_tokens", "prompt_tokens_mean", "serving",
                              "transport", "workload"]
    assert (report["model"], report["transport"], report["workload"], report["output_tokens"]) == (
        "qwen2_vl-tiny", "echo", spec.to_dict(), 6)
    serving = report["serving"]
    assert sorted(serving) == ["calls", "cpu_s", "failed", "itl_s", "out_tok_per_s", "profile", "req_per_s",
                               "time_split", "ttft_s", "wall_s"]
    assert (serving["failed"], serving["req_per_s"], serving["out_tok_per_s"]) == (0, 1.0, 3.0)
    assert serving["ttft_s"]["p50"] == 0.5 and serving["itl_s"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert outcome.lines == ["dtype: tgi-vlm not reported (HTTP)"]


def test_the_prefix_comparison_runs_the_load_once_with_the_cache_off_then_on():
    from tgi_vlm.benchmarking.comparisons import run_modes

    modes = []

    class Recording(EchoTarget):
        async def run(self, load, *, prefix_caching=None, **kwargs):
            modes.append(prefix_caching)
            return ServingResult(1.0, [], [], {})

    results = asyncio.run(run_modes(Recording(), Requests(WorkloadSpec(), [item(1)])))
    assert modes == [False, True] and list(results) == ["off", "on"]


def test_bench_options_keep_the_workload_flags_a_workload_reads():
    o = replace(WorkloadOptions(), num_requests=3, system_tokens=0, seed=7)
    assert workloads.serving_spec(o, 256) == WorkloadSpec(num_requests=3, seed=7, system_tokens=256)
