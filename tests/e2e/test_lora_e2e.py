"""LoRA adapters end to end on the tiny llama with two peft adapters: `tgi-vlm launch --lora-adapters` answering
`adapter_id` on /generate and `model` on the OpenAI routes as TGI does (an unknown adapter a 422 naming it), and its
shard driven by the router driver for the prefix-cache trap (one prompt under two adapters never shares a block,
under one adapter it does; every Prefill's cache_len checked on the wire). Every output is transformers' greedy run on the base model with that adapter
merged (`merge_and_unload`)."""

from __future__ import annotations

import asyncio
import tempfile

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.e2e.driving import drive_router, tokens_of
from tests.e2e.launching import Launch
from tests.e2e.test_prefix_cache_e2e import RecordingClient
from tests.models.lora_reference import RECIPES, make_adapter, merged_model
from tests.models.reference import hf_greedy
from tgi_vlm.router import RequestParams, RouterConfig, TokenCounter
from tgi_vlm.testing import tiny_model_path

ARCH, BS, N = "llama", 16, 6
PROMPT = ("You are a careful assistant who answers in plain words and never makes up details. "
          "Tell me what the weather is like at the sea today")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-e2e")
    return {name: make_adapter(ARCH, root / name, RECIPES[name]) for name in ("lora-all", "lora-rs")}


def flag(adapters: dict) -> str:
    return ",".join(f"{name}={path}" for name, path in adapters.items())


@pytest.fixture(scope="module")
def expected(adapters) -> dict:
    """adapter ("" = base) -> transformers' greedy ids for PROMPT on the merged model."""
    ids = AutoTokenizer.from_pretrained(tiny_model_path(ARCH))(PROMPT)["input_ids"]
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    return {name: hf_greedy(merged_model(ARCH, adapters.get(name)), inputs, N).ids for name in ("", *adapters)}


# ----- tgi-vlm launch -----

@pytest.fixture(scope="module")
def launch(adapters, tmp_path_factory):
    """One launch (and its shard) for the module; the driver test last reaches the same shard by its socket."""
    socket = tempfile.mkdtemp(dir="/tmp", prefix="tv-") + "/s"  # unix socket paths must stay short
    server = Launch(str(tiny_model_path(ARCH)), "--max-input-tokens", "200", "--max-total-tokens", "300",
                    "--lora-adapters", flag(adapters), "--shard-uds-path", socket, *FLOAT32_SHARD_ARGS)
    server.shard_socket = f"{socket}-0"
    yield server
    assert server.stop() == 0, "".join(server.output[-30:])


def post(launch: Launch, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{launch.url}{path}", json=body, timeout=120)


def test_info_lists_the_adapters_requests_may_name(launch, adapters):
    assert httpx.get(f"{launch.url}/info").json()["lora_adapters"] == list(adapters)


def test_generate_runs_each_requests_adapter_in_one_batch(launch, expected):
    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"inputs": PROMPT, "parameters": {"max_new_tokens": N, "details": True, "decoder_input_details":
                                                        False, **({"adapter_id": a} if a else {})}} for a in expected]
            return await asyncio.gather(*[client.post(f"{launch.url}/generate", json=b) for b in bodies])

    responses = asyncio.run(all_at_once())
    got = [[t["id"] for t in r.json()["details"]["tokens"]] for r in responses]
    assert got == list(expected.values())


def test_the_openai_model_field_names_the_adapter_when_one_is_loaded_by_that_name(launch, expected):
    """TGI reads `model` as the adapter; a name that is not a loaded adapter ("tgi", the model's id, anything a client
    was configured with) runs on the base model, as TGI serves an unknown adapter id."""
    for model, adapter in (("lora-rs", "lora-rs"), ("tgi", ""), (str(tiny_model_path(ARCH)), ""), ("lora-nope", "")):
        response = post(launch, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": N,
                                                    "temperature": 0, "logprobs": None})
        assert response.status_code == 200, response.text
        generate = post(launch, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": N, **(
            {"adapter_id": adapter} if adapter else {})}}).json()["generated_text"]
        assert response.json()["choices"][0]["text"] == generate
    assert expected["lora-rs"] != expected[""]  # so the first comparison tells the adapter from the base model


def test_an_unknown_adapter_id_is_a_422_naming_it(launch):
    response = post(launch, "/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "lora-nope"}})
    assert response.status_code == 422
    message = ("Input validation error: adapter_id 'lora-nope' is not a loaded LoRA adapter (loaded: 'lora-all', "
               "'lora-rs'; leave adapter_id empty for the base model)")
    assert response.json() == {"error": message, "error_type": "validation"}


# ----- the router driver against the launch's shard (last: its warmup resizes that shard's cache) -----

def test_zz_one_prompt_under_two_adapters_never_shares_a_block_and_under_one_adapter_does(launch, adapters, expected):
    counter = TokenCounter(str(tiny_model_path(ARCH)))
    order = ["lora-all", "lora-rs", "", "lora-all"]

    async def scenario(router, client):
        assert list(router.shard.info.lora_adapters) == list(adapters)
        outputs = []
        for adapter in order:
            stream = await router.submit(RequestParams([PROMPT], max_new_tokens=N, ignore_eos=True, adapter_id=adapter))
            ids, final = await tokens_of(stream)
            assert final.ok, final.error
            outputs.append((client.requests(stream.request_id), ids))
        return outputs, router.prefix_stats

    outputs, stats = drive_router(f"unix://{launch.shard_socket}", counter.tokenize, scenario, client=RecordingClient,
                                  timeout=120, config=RouterConfig(max_input_tokens=200, max_total_tokens=300))
    full_blocks = (len(counter.tokenize(RequestParams([PROMPT]).to_pb(0)).ids) - 1) // BS
    assert full_blocks >= 2
    assert [[r.cache_len for r in sent] for sent, _ in outputs] == [[0], [0], [0], [full_blocks * BS]]
    assert stats.refused_claims == 0
    assert [ids for _, ids in outputs] == [expected[a] for a in order]
