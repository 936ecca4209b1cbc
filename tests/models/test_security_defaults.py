"""The shard never unpickles weights: a model shipped only as pytorch_model.bin is refused, by the
text loader (AutoModelForCausalLM) and by the vision-language loader (load_vlm) alike."""

from __future__ import annotations

import shutil

import pytest
import torch
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
