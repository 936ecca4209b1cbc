"""The shard never unpickles weights: a model shipped only as pytorch_model.bin is refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.testing import tiny_model_path


def test_pickle_only_weights_are_not_loaded(tmp_path):
    source = tiny_model_path("llama")
    target = tmp_path / "pickled"
    shutil.copytree(source, target)
    model = AutoModelForCausalLM.from_pretrained(source)
    (target / "model.safetensors").unlink()
    torch.save(model.state_dict(), target / "pytorch_model.bin")  # a pickle: loading it could run code
    assert not list(target.glob("*.safetensors")) and list(target.glob("*.bin"))
    with pytest.raises(OSError, match="safetensors"):
        get_model(str(target), EngineConfig(device="cpu", cpu_kv_cache_bytes=1 << 20))
