"""Build tiny random models offline, and cache them on disk.

Known issue, left alone on purpose: in transformers 5.24 `Llama4ForConditionalGeneration.forward`
reads `outputs.image_outputs` from a `MoeCausalLMOutputWithPast`, so every `return_dict=True`
forward (and therefore `generate`) raises AttributeError. The built llama4 model is correct;
callers run it with `return_dict=False` or call the language model directly.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig, PreTrainedModel

from tgi_vlm.testing.recipes import RECIPES, Recipe
from tgi_vlm.testing.sizes import get_sizes
from tgi_vlm.testing.tokenizer import build_tokenizer

ARCHS: tuple[str, ...] = tuple(RECIPES)
TEXT_ARCHS: tuple[str, ...] = tuple(arch for arch, recipe in RECIPES.items() if not recipe.is_vlm)
VLM_ARCHS: tuple[str, ...] = tuple(arch for arch, recipe in RECIPES.items() if recipe.is_vlm)

# Bump when a build changes (recipes, sizes, tokenizer), so cached models are rebuilt.
BUILDER_VERSION = 2  # 2: Qwen2-VL / Qwen2.5-VL carry a chat template

CACHE_ENV = "TGI_VLM_TINY_CACHE"


def _recipe(arch: str) -> Recipe:
    if arch not in RECIPES:
        raise ValueError(f"unknown tiny-model architecture {arch!r}; expected one of {', '.join(ARCHS)}")
    return RECIPES[arch]


def build_tiny_model(arch: str, out_dir: str | Path, *, size: str = "tiny", seed: int = 0,
                     kv_heads: int | None = None) -> Path:
    """Write a complete random model directory for `arch` to `out_dir` and return its path.

    The directory holds config.json, model.safetensors (float32), generation_config.json, the
    tokenizer files and, for vision-language models, the processor files (Qwen2-VL and Qwen2.5-VL also
    chat_template.jinja, their real template); it reloads with
    `AutoProcessor` + `AutoModelForImageTextToText` (VLMs) or `AutoTokenizer` +
    `AutoModelForCausalLM` (TEXT_ARCHS). The same `arch`, `size` and `seed` give the same files.

    Sizes (parameter counts as built; the tokenizer is trained on a seeded generated corpus):
      - "tiny": text 64 wide, 2 layers, 4 query / 2 KV heads of 16, MLP 128, vision towers 32
        wide with 2 layers; vocab ~660 (PaliGemma ~1.8k with its 1,152 <loc>/<seg> tokens);
        0.16-0.28M parameters, 0.6-1.1 MB, built in ~0.1-0.4 s once transformers is imported.
        Images are resized to at most 112 px a side, so a 20×20 image is 4-20 image tokens.
      - "bench": text 768 wide, 12 layers, 12 query / 4 KV heads of 64, MLP 2560, vocab ~3.8k,
        vision towers 256 wide with 4 layers: llama 95.4M, qwen2 95.5M, qwen2_vl 100.8M
        (images up to 448 px a side → ≤ 256 image tokens), the other VLMs 96-110M, llama4 171M
        (two MoE experts on every other layer); ~370 MB, 3-7 s. Init std 0.05 (tiny: 0.3) keeps
        greedy output varied at this depth.

    `kv_heads` overrides the size's key/value head count (e.g. 1: fewer KV heads than two
    tensor-parallel ranks); the rest of the model is built as without it.
    """
    recipe = _recipe(arch)
    sizes = get_sizes(size)
    if kv_heads is not None:
        if kv_heads < 1 or sizes.heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide the {sizes.heads} attention heads of size {size!r}")
        sizes = dataclasses.replace(sizes, kv_heads=kv_heads)
    _refuse_building_on_a_nonzero_rank()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(recipe.tokenizer, seed=seed, num_merges=sizes.num_merges)
    processor = recipe.processor(tokenizer, sizes) if recipe.processor else None
    if recipe.chat_template is not None:
        tokenizer.chat_template = recipe.chat_template
        if processor is not None:
            processor.chat_template = recipe.chat_template
    config = recipe.config(tokenizer, sizes)  # after the processor: it may add tokens
    model = _random_model(config, is_vlm=recipe.is_vlm, seed=seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    model.save_pretrained(out_dir, safe_serialization=True)
    (processor or tokenizer).save_pretrained(out_dir)
    return out_dir


def _refuse_building_on_a_nonzero_rank() -> None:
    """Inside a torch.distributed group, transformers' save_pretrained writes weights on rank 0 only:
    a model built on another rank would lack them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        raise RuntimeError("tiny models cannot be built on a rank other than 0 of a process group; "
                           "build them (tiny_model_path) before starting the ranks")


def _random_model(config, *, is_vlm: bool, seed: int) -> PreTrainedModel:
    auto_class = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
        _randomize_zero_matrices(model, std=config.get_text_config().initializer_range)
    return model.eval()


@torch.no_grad()
def _randomize_zero_matrices(model: PreTrainedModel, std: float) -> None:
    """Give random values to weight matrices the library initializes to zero.

    Gemma3's `mm_input_projection_weight` starts at zero, which makes every image embed to the
    same vector, so images could not change the output. Norm weights (1-D) keep their init.
    """
    for param in model.parameters():
        if param.dim() >= 2 and not param.any():
            param.normal_(0.0, std)


def cache_dir() -> Path:
    """Where `tiny_model_path` keeps built models: $TGI_VLM_TINY_CACHE or ~/.cache/tgi-vlm/tiny."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "tgi-vlm" / "tiny"


def tiny_model_path(arch: str, *, size: str = "tiny", kv_heads: int | None = None) -> Path:
    """The cached model directory for (`arch`, `size`, seed 0, `kv_heads`), built on first use.

    Safe when several processes ask at once: each builds into its own temporary directory and
    renames it into place; a process that loses the race discards its copy and uses the winner's.
    """
    _recipe(arch)
    get_sizes(size)
    name = f"{arch}-{size}" if kv_heads is None else f"{arch}-{size}-kv{kv_heads}"
    final = cache_dir() / f"v{BUILDER_VERSION}" / name
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{arch}-{size}-", dir=final.parent))
    try:
        build_tiny_model(arch, staging, size=size, kv_heads=kv_heads)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(staging, final)  # atomic; fails if another process already put `final` there
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
