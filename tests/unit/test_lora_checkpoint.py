"""Loading peft adapters: `--lora-adapters` syntax, and every refusal at start names the adapter and the problem
(pickle-only weights, paths escaping the adapter directory, shapes or ranks that do not fit the model, targets
outside the language model, peft features that are not a per-row delta)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import load_engine
from tests.models.lora_reference import RECIPES, make_adapter
from tgi_vlm.lora import AdapterSpec, parse_lora_adapters
from tgi_vlm.lora.checkpoint import AdapterError, load_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A peft adapter for the tiny llama (rank 4, q/v)."""
    return make_adapter("llama", tmp_path_factory.mktemp("lora") / "good", RECIPES["lora-qv"])


@pytest.fixture
def copy(good, tmp_path):
    def make(name: str = "copy"):
        return shutil.copytree(good, tmp_path / name)
    return make


def edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(path, change):
    tensors = load_file(path / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


# ----- the flag -----

def test_lora_adapters_take_tgis_id_path_and_revision_syntax():
    assert parse_lora_adapters(" a, b=/x/y ,c@main,d=/p@v1") == (
        AdapterSpec("a"), AdapterSpec("b", "/x/y"), AdapterSpec("c", None, "main"), AdapterSpec("d", "/p", "v1"))
    assert parse_lora_adapters("") == parse_lora_adapters(None) == ()


@pytest.mark.parametrize(("text", "message"), [("a,,b", "'' is not id"), ("a=b=c", "'a=b=c' is not id"),
                                              ("a@1@2", "is not id"), ("x,y,x", "'x' given more than once")])
def test_malformed_lora_adapters_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_adapters(text)


# ----- the checkpoint on its own -----

def test_a_peft_adapter_loads_with_its_pairs_and_peft_scale(good):
    checkpoint = load_checkpoint(AdapterSpec("qv", str(good)))
    assert sorted({name.rsplit(".", 1)[1] for name in checkpoint.modules}) == ["q_proj", "v_proj"]
    assert len(checkpoint.modules) == 4  # 2 layers x q, v
    pair = checkpoint.modules["model.layers.0.self_attn.q_proj"]
    assert (tuple(pair.a.shape), tuple(pair.b.shape), pair.scale) == ((4, 64), (64, 4), 2.0)  # alpha 8 / r 4


def test_rslora_scales_by_the_square_root_of_the_rank(copy):
    path = copy()
    edit_config(path, use_rslora=True)
    assert load_checkpoint(AdapterSpec("rs", str(path))).modules["model.layers.1.self_attn.v_proj"].scale == 4.0


def test_a_pickle_only_adapter_is_refused_and_never_unpickled(copy):
    path = copy()
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"LoRA adapter 'pk': .*no adapter_model.safetensors \(found "
                                           r"adapter_model.bin: pickled weights are never loaded"):
        load_checkpoint(AdapterSpec("pk", str(path)))


def test_a_path_with_parent_references_is_refused(good):
    escaping = f"{good}/../{good.name}"
    with pytest.raises(AdapterError, match=r"LoRA adapter 'up': path .* contains '\.\.'"):
        load_checkpoint(AdapterSpec("up", escaping))


def test_a_weights_file_linked_from_outside_the_adapter_directory_is_refused(good, tmp_path):
    path = tmp_path / "linked"
    path.mkdir()
    shutil.copy(good / "adapter_config.json", path)
    (path / "adapter_model.safetensors").symlink_to(good / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="'linked': adapter_model.safetensors resolves outside the adapter dir"):
        load_checkpoint(AdapterSpec("linked", str(path)))


@pytest.mark.parametrize(("change", "message"), [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\]: replaces whole modules"),
    ({"use_dora": True}, "use_dora=True: DoRA"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
    ({"r": 8}, "rank 4 in the weights but r=8"),
])
def test_peft_features_that_are_not_a_per_row_delta_are_refused_by_name(copy, change, message):
    path = copy()
    edit_config(path, **change)
    with pytest.raises(AdapterError, match=f"LoRA adapter 'bad': .*{message}"):
        load_checkpoint(AdapterSpec("bad", str(path)))


# ----- against the model -----

def test_an_adapter_whose_shapes_do_not_fit_the_model_is_refused_at_load(copy):
    path = copy()
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    edit_weights(path, lambda t: t.update({key: t[key][:, :48].contiguous()}))
    with pytest.raises(AdapterError, match=r"'wide': model.layers.1.self_attn.v_proj: lora_A \(4, 48\) and lora_B "
                                           r"\(32, 4\) do not fit a 64 -> 32 layer"):
        load_engine("llama", lora_adapters=(AdapterSpec("wide", str(path)),))


def test_an_adapter_for_the_lm_head_is_refused_the_head_and_vision_tower_stay_base(tmp_path):
    path = make_adapter("llama", tmp_path / "head", RECIPES["lora-qv"], target_modules=["lm_head"])
    with pytest.raises(AdapterError, match="'head': targets 'lm_head', outside the language model"):
        load_engine("llama", lora_adapters=(AdapterSpec("head", str(path)),))


def test_an_adapter_for_modules_the_model_lacks_is_refused(copy):
    path = copy()
    key = "base_model.model.model.layers.1.self_attn.v_proj"
    edit_weights(path, lambda t: t.update({f"{key.replace('1', '7')}.lora_{s}.weight": t[f"{key}.lora_{s}.weight"].clone()
                                           for s in "AB"}))
    with pytest.raises(AdapterError, match="'other': targets 'model.layers.7.self_attn.v_proj', which this model "
                                           "does not have"):
        load_engine("llama", lora_adapters=(AdapterSpec("other", str(path)),))


def test_a_hub_id_is_read_through_the_hf_cache_with_only_the_adapter_files(good, monkeypatch):
    import huggingface_hub

    calls = []

    def snapshot(**kwargs):
        calls.append(kwargs)
        return str(good)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    checkpoint = load_checkpoint(AdapterSpec("org/some-lora", None, "v2"))
    assert checkpoint.path == good and len(checkpoint.modules) == 4
    assert calls == [{"repo_id": "org/some-lora", "revision": "v2",
                      "allow_patterns": ["adapter_config.json", "adapter_model.safetensors"]}]


def test_adapters_are_refused_on_a_tensor_parallel_rank():
    from types import SimpleNamespace

    from tgi_vlm.lora.attach import attach_adapters

    engine = SimpleNamespace(layout=SimpleNamespace(world_size=2))
    with pytest.raises(ValueError, match="--lora-adapters with --num-shard 2: LoRA adapters are served on one shard"):
        attach_adapters(engine, (AdapterSpec("a", "/nowhere"),))
