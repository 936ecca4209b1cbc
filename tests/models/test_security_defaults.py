"""What loading trusts (README, "What the shard trusts"): weights only from safetensors, by the text
loader (AutoModelForCausalLM) and the vision-language loader (load_vlm) alike, so a model shipped only
as pytorch_model.bin is refused; trust_remote_code off unless asked for, in every transformers load."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.testing import tiny_model_path


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])  # the text loader and the vision-language loader
def test_pickle_only_weights_are_not_loaded(tmp_path, arch):
    source = tiny_model_path(arch)
    target = tmp_path / "pickled"
    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    torch.save(state, target / "pytorch_model.bin")  # the same weights as a pickle: loading it could run code
    assert not list(target.glob("*.safetensors")) and list(target.glob("*.bin"))
    with pytest.raises(OSError, match=r"model\.safetensors"):
        get_model(str(target), EngineConfig(device="cpu", cpu_kv_cache_bytes=1 << 20))


LOADERS = ("AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoTokenizer", "AutoProcessor")


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
@pytest.mark.parametrize("trust", [None, True], ids=["default", "asked"])
def test_every_transformers_load_gets_trust_remote_code_as_asked(monkeypatch, arch, trust):
    """get_model's default is off, and whatever it is given reaches every from_pretrained it makes."""
    seen: list[tuple[str, object]] = []
    for name in LOADERS:
        cls = getattr(transformers, name)

        def spy(*args, _load=cls.from_pretrained, _name=name, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code", "not passed")))
            return _load(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", staticmethod(spy))
    kwargs = {} if trust is None else {"trust_remote_code": trust}
    get_model(str(tiny_model_path(arch)), EngineConfig(device="cpu", cpu_kv_cache_bytes=1 << 20), **kwargs)
    expected = trust is True
    loaders = {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"} if arch == "llama" else {
        "AutoConfig", "AutoModelForImageTextToText", "AutoProcessor"}
    assert loaders <= {name for name, _ in seen}, seen
    assert all(value is expected for _, value in seen), seen
