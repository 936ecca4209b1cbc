"""Model sizes for the tiny random models: `tiny` for tests, `bench` for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """Dimensions shared by every architecture recipe.

    Text: `hidden` = `heads` × `head_dim`. Vision towers are `vision_hidden` wide with
    `vision_hidden // vision_heads`-wide heads. `image_edge` is the largest side (pixels) an image
    is resized to, so it bounds the number of image tokens.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    num_merges: int  # BPE merges; vocab ≈ specials + 256 bytes + merges
    initializer_range: float
    image_edge: int
    window: int  # sliding-window / attention-chunk size where an architecture has one


SIZES: dict[str, Sizes] = {
    # 0.16-0.28M parameters (0.6-1.1 MB). A large init range keeps random logits varied
    # across positions, so greedy output is not one token forever and images change it.
    "tiny": Sizes(
        hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
        vision_hidden=32, vision_layers=2, vision_heads=2,
        num_merges=400, initializer_range=0.3, image_edge=112, window=32,
    ),
    # llama 95.4M, qwen2_vl 100.8M parameters (see build_tiny_model's docstring for the rest).
    # With std 0.02 greedy repeats one token forever at this depth; 0.05 stays varied.
    "bench": Sizes(
        hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2560,
        vision_hidden=256, vision_layers=4, vision_heads=4,
        num_merges=3500, initializer_range=0.05, image_edge=448, window=4096,
    ),
}  # fmt: skip


def get_sizes(size: str) -> Sizes:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {sorted(SIZES)}")
    return SIZES[size]
