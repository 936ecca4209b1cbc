"""Tiny random models: built offline, reloaded through transformers' Auto classes, usable for parity."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from tgi_vlm.testing import (
    ARCHS,
    TEXT_ARCHS,
    VLM_ARCHS,
    build_tiny_model,
    jpeg_bytes,
    make_test_image,
    png_bytes,
    tiny_model_path,
)

NEW_TOKENS = 4

# Image tokens (the config's image token id) the processor puts in the prompt for one image.
# (20×20, 37×53) → counts; fixed by the recipes' image sizes, so a change here is a real change.
IMAGE_TOKENS = {
    "qwen2_vl": (4, 6),  # resized to 56×56 / 56×84 (multiples of 28, area ≥ 56²), 2×2 merge
    "qwen2_5_vl": (4, 6),
    "llava_next": (10, 16),  # base 28 px tile (4) + anyres grid tiles with row newlines
    "idefics2": (4, 4),  # perceiver latents
    "idefics3": (20, 20),  # upscaled to 112 px: 2×2 tiles + global tile, 4 each
    "smolvlm": (20, 20),
    "paligemma": (4, 4),  # image_seq_length
    "gemma3": (4, 4),  # mm_tokens_per_image
    "llama4": (4, 4),  # one 56 px tile, pixel-shuffled to 4 <|patch|> tokens
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture built once for this module (builds are ~0.1-1 s each)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHS}


def _load_vlm(model_dir: Path) -> tuple[Any, Any]:
    return AutoProcessor.from_pretrained(model_dir), AutoModelForImageTextToText.from_pretrained(model_dir)


def _image_token_id(config: Any) -> int:
    token_id = getattr(config, "image_token_id", None)
    return token_id if token_id is not None else config.image_token_index


def _vlm_inputs(processor: Any, image: Image.Image) -> dict[str, torch.Tensor]:
    inputs = processor(text=f"Describe {processor.image_token} in a word.", images=image, return_tensors="pt")
    inputs.pop("labels", None)  # PaliGemmaProcessor returns labels even without a suffix
    # Llama4's image processor returns bfloat16 pixel values; the tiny models are float32.
    return {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}


def _greedy(arch: str, model: Any, inputs: dict[str, torch.Tensor], n: int) -> list[int]:
    """`n` greedy tokens after the prompt, from transformers' own generate()."""
    with _llama4_output_fix() if arch == "llama4" else contextlib.nullcontext():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _llama4_output_fix() -> contextlib.AbstractContextManager:
    """transformers 5.24 bug: Llama4ForConditionalGeneration.forward reads `outputs.image_outputs`
    from its language model's MoeCausalLMOutputWithPast, which has no such field, so every forward
    (return_dict=False too: the output-capturing decorator forces a dict inside) and generate()
    raise AttributeError. A class-level default for the missing field, only while generating."""
    return mock.patch.object(MoeCausalLMOutputWithPast, "image_outputs", None, create=True)


# ---- the API ---------------------------------------------------------------------------------


def test_archs_are_the_text_archs_then_the_vlm_archs():
    assert set(ARCHS) == set(TEXT_ARCHS) | set(VLM_ARCHS)
    assert set(TEXT_ARCHS) == {"llama", "qwen2", "mistral", "gemma2", "gemma3_text", "phi3", "gpt2"}
    assert set(VLM_ARCHS) == set(IMAGE_TOKENS)


def test_unknown_arch_is_a_value_error_listing_the_known_ones(tmp_path: Path):
    with pytest.raises(ValueError, match="llama, qwen2, mistral, .*gpt2, qwen2_vl"):
        build_tiny_model("gpt9", tmp_path)


def test_unknown_size_is_a_value_error(tmp_path: Path):
    with pytest.raises(ValueError, match="bench"):
        build_tiny_model("llama", tmp_path, size="huge")


# ---- what a build writes ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_build_writes_config_weights_generation_config_and_tokenizer(arch: str, model_dirs: dict[str, Path]):
    files = {p.name for p in model_dirs[arch].iterdir()}
    expected = {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    if arch in VLM_ARCHS:
        expected.add("processor_config.json")
    assert expected <= files
    assert (model_dirs[arch] / "model.safetensors").stat().st_size < 3_000_000


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_covers_the_tokenizer_and_eos_is_set_everywhere(arch: str, model_dirs: dict[str, Path]):
    model_dir = model_dirs[arch]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    generation_config = GenerationConfig.from_pretrained(model_dir)

    assert text_config["vocab_size"] >= len(tokenizer)
    assert tokenizer.eos_token_id is not None
    assert text_config["eos_token_id"] == tokenizer.eos_token_id
    assert generation_config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_same_seed_gives_identical_files_and_another_seed_other_weights(arch: str, tmp_path: Path):
    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    a = build_tiny_model(arch, tmp_path / "a", seed=0)
    b = build_tiny_model(arch, tmp_path / "b", seed=0)
    c = build_tiny_model(arch, tmp_path / "c", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name), name
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors")


# ---- text models -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_text_model_reloads_and_generates_the_requested_tokens(arch: str, model_dirs: dict[str, Path]):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch])
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    inputs = tokenizer("Hello world, the cat is 42 — café 你好", return_tensors="pt")

    generated = _greedy(arch, model, dict(inputs), NEW_TOKENS)

    assert len(generated) == NEW_TOKENS
    assert all(0 <= t < model.config.vocab_size for t in generated)


def test_tokenizer_round_trips_english_digits_punctuation_and_non_ascii(model_dirs: dict[str, Path]):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    text = "The 3 cats sat (quietly) on 12,345 mats; café, привет, 你好 🙂!"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned


# ---- vision-language models ------------------------------------------------------------------


@pytest.mark.parametrize("arch", VLM_ARCHS)
@pytest.mark.parametrize(("width", "height", "which"), [(20, 20, 0), (37, 53, 1)])
def test_vlm_processor_expands_the_image_and_model_generates(
    arch: str, width: int, height: int, which: int, model_dirs: dict[str, Path]
):
    processor, model = _load_vlm(model_dirs[arch])
    inputs = _vlm_inputs(processor, make_test_image(width, height))

    num_image_tokens = int((inputs["input_ids"] == _image_token_id(model.config)).sum())
    generated = _greedy(arch, model, inputs, NEW_TOKENS)

    assert num_image_tokens == IMAGE_TOKENS[arch][which]
    assert len(generated) == NEW_TOKENS
    assert all(0 <= t < model.config.get_text_config().vocab_size for t in generated)


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_a_different_image_changes_the_greedy_continuation(arch: str, model_dirs: dict[str, Path]):
    processor, model = _load_vlm(model_dirs[arch])
    first = _greedy(arch, model, _vlm_inputs(processor, make_test_image(20, 20, seed=0)), NEW_TOKENS)
    second = _greedy(arch, model, _vlm_inputs(processor, make_test_image(20, 20, seed=1)), NEW_TOKENS)
    assert first != second


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_tokenizer_knows_the_processor_image_token_as_one_special_token(
    arch: str, model_dirs: dict[str, Path]
):
    processor = AutoProcessor.from_pretrained(model_dirs[arch])
    ids = processor.tokenizer(processor.image_token, add_special_tokens=False).input_ids
    assert ids == [processor.tokenizer.convert_tokens_to_ids(processor.image_token)]
    assert ids[0] != processor.tokenizer.unk_token_id


# ---- the cache ------------------------------------------------------------------------------


def test_tiny_model_path_builds_once_into_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TGI_VLM_TINY_CACHE", str(tmp_path))
    first = tiny_model_path("llama")
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns

    second = tiny_model_path("llama")

    assert second == first
    assert first.is_relative_to(tmp_path)
    assert (second / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_tiny_model_path_is_safe_when_builds_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TGI_VLM_TINY_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: tiny_model_path("qwen2"), range(3)))

    assert len(set(paths)) == 1
    assert AutoModelForCausalLM.from_pretrained(paths[0]).config.model_type == "qwen2"
    leftovers = [p.name for p in paths[0].parent.iterdir() if p != paths[0]]
    assert leftovers == []


def test_tiny_model_path_rejects_an_unknown_arch_before_touching_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("TGI_VLM_TINY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="qwen2_vl"):
        tiny_model_path("nope")
    assert not (tmp_path / "cache").exists()


# ---- bench size ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "low", "high"), [("llama", 90e6, 100e6), ("qwen2_vl", 95e6, 105e6)])
def test_bench_size_is_about_100m_parameters(arch: str, low: float, high: float, tmp_path: Path):
    model_dir = build_tiny_model(arch, tmp_path, size="bench")
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        num_params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    assert low < num_params < high


# ---- images ----------------------------------------------------------------------------------


def test_make_test_image_is_rgb_of_the_given_size_and_seeded():
    img = make_test_image(37, 53, seed=3)
    assert img.mode == "RGB" and img.size == (37, 53)
    assert img.tobytes() == make_test_image(37, 53, seed=3).tobytes()
    assert img.tobytes() != make_test_image(37, 53, seed=4).tobytes()


def test_png_bytes_decode_to_the_same_pixels_and_jpeg_to_the_same_size():
    img = make_test_image(20, 20)
    assert Image.open(io.BytesIO(png_bytes(img))).tobytes() == img.tobytes()
    decoded = Image.open(io.BytesIO(jpeg_bytes(img)))
    assert decoded.format == "JPEG" and decoded.size == (20, 20)
