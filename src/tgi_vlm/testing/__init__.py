"""Tiny random models for every supported architecture, built offline in seconds.

Used by the tests, `make run` and the benchmarks; nothing is downloaded.

    ARCHS, TEXT_ARCHS, VLM_ARCHS                          supported architecture names
    build_tiny_model(arch, out_dir, size="tiny", seed=0)  write a model directory
    tiny_model_path(arch, size="tiny", kv_heads=None)     the same, built once into a shared cache
                                                          (kv_heads=1: fewer KV heads than 2 TP ranks)
    make_test_image(width, height, seed=0)                random-noise RGB image
    png_bytes(img) / jpeg_bytes(img)                      encoded image bytes
"""

from tgi_vlm.images import jpeg_bytes, make_test_image, png_bytes
from tgi_vlm.testing.builder import (
    ARCHS,
    BUILDER_VERSION,
    TEXT_ARCHS,
    VLM_ARCHS,
    build_tiny_model,
    cache_dir,
    tiny_model_path,
)

__all__ = [
    "ARCHS",
    "BUILDER_VERSION",
    "TEXT_ARCHS",
    "VLM_ARCHS",
    "build_tiny_model",
    "cache_dir",
    "jpeg_bytes",
    "make_test_image",
    "png_bytes",
    "tiny_model_path",
]
