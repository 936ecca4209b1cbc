"""Tensor-parallel planning without processes: which KV heads a rank keeps, and what is refused;
the rank agreement's merge of refusals. (tests/distributed/ runs the real two-rank engines.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tgi_vlm.errors import InvalidRequest
from tgi_vlm.models.rank_agreement import RankAgreement, RankFailed, Refusal
from tgi_vlm.models.tensor_parallel import ShardLayout, keep_own_kv_head, load_kwargs, plan_layout
from tgi_vlm.testing import tiny_model_path


def config(arch="llama", **text):
    hf = AutoConfig.from_pretrained(tiny_model_path(arch))
    for name, value in text.items():
        setattr(hf.get_text_config(), name, value)
    return hf


def test_kv_heads_that_divide_by_the_ranks_are_split_and_the_plan_is_left_alone():
    hf = config(num_attention_heads=8, num_key_value_heads=4)
    assert plan_layout(hf, 1, 2) == ShardLayout(1, 2, kv_heads=2)
    assert hf.get_text_config().base_model_tp_plan["layers.*.self_attn.k_proj"] == "colwise"


@pytest.mark.parametrize(("rank", "head"), [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_fewer_kv_heads_than_ranks_each_rank_keeps_the_head_its_query_heads_use(rank, head):
    hf = config(num_attention_heads=8, num_key_value_heads=2)  # ranks 0-1 hold query heads 0-3 → KV head 0
    assert plan_layout(hf, rank, 4) == ShardLayout(rank, 4, kv_heads=1, replicated_kv_head=head)
    plan = hf.get_text_config().base_model_tp_plan
    assert (plan["layers.*.self_attn.k_proj"], plan["layers.*.self_attn.v_proj"]) == ("replicate", "replicate")
    assert plan["layers.*.self_attn.q_proj"] == "colwise"
    assert type(hf.get_text_config()).base_model_tp_plan["layers.*.self_attn.k_proj"] == "colwise"  # class untouched


def test_keeping_the_own_kv_head_cuts_every_k_and_v_projection_to_that_heads_rows():
    path = tiny_model_path("llama")  # 4 query / 2 KV heads of 16: rank 3 of 4 keeps KV head 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    whole = {n: p.clone() for n, p in model.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight"))}
    layout = plan_layout(model.config, 3, 4)
    keep_own_kv_head(model.get_decoder(), model.config.get_text_config(), layout)
    assert len(whole) == 4
    for name, before in whole.items():
        after = dict(model.named_parameters())[name]
        assert torch.equal(after, before[16:32])
    assert model.model.layers[0].self_attn.k_proj.out_features == 16


@pytest.mark.parametrize(("arch", "text", "world", "message"), [
    ("gpt2", {}, 2, "model type 'gpt2' has no tensor-parallel plan in transformers; serve it with one shard"),
    ("llama", {}, 3, "llama: 4 attention heads cannot be split across 3 shards"),
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     "llama: 3 key/value heads can be neither split across nor replicated on 2 shards"),
])
def test_models_that_cannot_be_split_are_refused_before_loading(arch, text, world, message):
    with pytest.raises(ValueError, match=message):
        plan_layout(config(arch, **text), 0, world)


def test_fused_qkv_is_gathered_by_transformers_so_every_rank_attends_with_all_heads():
    assert plan_layout(config("phi3"), 0, 2) == ShardLayout(0, 2, kv_heads=2)


def test_unsharded_layout_holds_every_kv_head_and_changes_nothing():
    hf = config()
    assert plan_layout(hf, 0, 1) == ShardLayout(0, 1, kv_heads=2)
    assert "base_model_tp_plan" not in vars(hf.get_text_config())


class FakeRanks(RankAgreement):
    """Two ranks whose exchange returns what each rank sent (this process plays rank 0)."""

    def __init__(self, other):
        super().__init__(world_size=2)
        self.other = other

    def _gather(self, value):
        return [value, self.other]


def test_every_rank_refuses_the_union_with_the_lowest_ranks_message_in_batch_order():
    mine = [Refusal(2, InvalidRequest(7, "rank 0 says no"))]
    other = ([(2, 7, "rank 1 says no"), (0, 5, "only rank 1 refuses this")], None)
    errors = FakeRanks(other).agree("batch 1", mine)
    assert [str(e) for e in errors] == ["request 5: only rank 1 refuses this", "request 7: rank 0 says no"]


def test_a_rank_that_failed_outright_fails_every_rank():
    with pytest.raises(RankFailed, match=r"rank 1 failed during batch 1 \(tokenize\): MemoryError: boom"):
        FakeRanks(([], "MemoryError: boom")).agree("batch 1 (tokenize)", [])
    with pytest.raises(KeyError):  # the failed rank raises its own error
        FakeRanks(([], None)).agree("batch 1", [], failure=KeyError("mine"))


def test_unsharded_agreement_exchanges_nothing():
    refusals = [Refusal(1, InvalidRequest(3, "b")), Refusal(0, InvalidRequest(2, "a"))]
    assert [e.request_id for e in RankAgreement().agree("batch", refusals)] == [2, 3]
    assert RankAgreement().minimum(41) == 41


def test_loading_a_shard_without_a_process_group_says_what_to_call_first():
    hf = config()
    with pytest.raises(RuntimeError, match=r"world_size=2 but no process group: call tgi_vlm.distributed.initialize"):
        load_kwargs(hf, plan_layout(hf, 0, 2), "cpu")
    assert load_kwargs(hf, plan_layout(hf, 0, 1), "cpu") == {}
