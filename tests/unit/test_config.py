"""The environment variables README's "Limits" table names: their defaults and that each is read;
and the KV-cache size README's "Warmup" gives for a GPU, from CUDA_MEMORY_FRACTION and TGI_WIGGLE_ROOM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tgi_vlm.config import EngineConfig, InputLimits, ServerConfig
from tgi_vlm.models.flash_causal_lm import FlashCausalLM
from tgi_vlm.models.rank_agreement import RankAgreement

MiB = 1 << 20


def test_defaults_are_the_readmes():
    config = ServerConfig.from_env("m", {"TGI_VLM_DEVICE": "cpu"})
    engine = config.engine
    assert engine.limits == InputLimits(max_images_per_request=16, max_image_bytes=20 * MiB,
                                        max_image_pixels=64 * MiB)
    assert (config.max_message_bytes, config.shutdown_grace_s, config.dist_timeout_s) == (2**31 - 1, 10.0, 120.0)
    assert (engine.cpu_kv_cache_bytes, engine.encoder_cache_bytes) == (1 << 30, 256 * MiB)
    assert engine.prefix_caching is False
    assert engine.decode_mirror_share == 0.5
    assert EngineConfig.from_env({"TGI_VLM_DEVICE": "cuda"}).decode_mirror_share == 0.0


def test_every_variable_is_read():
    env = {
        "TGI_VLM_DEVICE": "cpu", "TGI_VLM_MAX_IMAGES_PER_REQUEST": "3", "TGI_VLM_MAX_IMAGE_BYTES": "1000",
        "TGI_VLM_MAX_IMAGE_PIXELS": "4096", "TGI_VLM_MAX_MESSAGE_BYTES": "5000", "TGI_VLM_SHUTDOWN_GRACE_S": "2.5",
        "TGI_VLM_DIST_TIMEOUT_S": "30", "TGI_VLM_CPU_KV_CACHE_GB": "0.5", "TGI_VLM_ENCODER_CACHE_MB": "0", "PREFIX_CACHING": "1",
        "TGI_VLM_DECODE_MIRROR": "0.25",
    }  # fmt: skip
    config = ServerConfig.from_env("m", env)
    engine = config.engine
    assert engine.limits == InputLimits(max_images_per_request=3, max_image_bytes=1000, max_image_pixels=4096)
    assert (config.max_message_bytes, config.shutdown_grace_s, config.dist_timeout_s) == (5000, 2.5, 30.0)
    assert (engine.cpu_kv_cache_bytes, engine.encoder_cache_bytes) == (1 << 29, 0)
    assert engine.prefix_caching is True
    assert engine.decode_mirror_share == 0.25


def test_the_video_limits_default_to_the_readmes_and_each_is_read():
    limits = InputLimits.from_env({})
    assert (limits.max_videos_per_request, limits.max_video_bytes, limits.max_video_frames,
            limits.max_video_source_frames, limits.max_video_seconds, limits.max_video_frame_pixels,
            limits.max_video_pixels, limits.video_decode_timeout_s, limits.video_fps) == (
        2, 64 * MiB, 32, 36000, 1200.0, 4096 * 2160, 32 * 1280 * 720, 20.0, 2.0)
    assert limits.video_codecs == ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg", "ffv1")
    names = ("MAX_VIDEOS_PER_REQUEST", "MAX_VIDEO_BYTES", "MAX_VIDEO_FRAMES", "MAX_VIDEO_SOURCE_FRAMES",
             "MAX_VIDEO_SECONDS", "MAX_VIDEO_FRAME_PIXELS", "MAX_VIDEO_PIXELS", "VIDEO_DECODE_TIMEOUT_S", "VIDEO_FPS")
    read = InputLimits.from_env({**{f"TGI_VLM_{n}": str(i + 3) for i, n in enumerate(names)},
                                 "TGI_VLM_VIDEO_CODECS": "h264, vp9"})
    assert (read.max_videos_per_request, read.max_video_bytes, read.max_video_frames, read.max_video_source_frames,
            read.max_video_seconds, read.max_video_frame_pixels, read.max_video_pixels, read.video_decode_timeout_s,
            read.video_fps, read.video_codecs) == (3, 4, 5, 6, 7.0, 8, 9, 10.0, 11.0, ("h264", "vp9"))
    with pytest.raises(ValueError, match="video limits must be positive"):
        InputLimits.from_env({"TGI_VLM_VIDEO_FPS": "0"})
    # the driver's counter: its process environment with the shard's own on top
    assert InputLimits.from_env({"TGI_VLM_MAX_VIDEO_FRAMES": "4"}, {"TGI_VLM_MAX_VIDEO_BYTES": "9"}).max_video_frames == 4
    assert InputLimits.from_env({"TGI_VLM_MAX_VIDEO_BYTES": "4"}, {"TGI_VLM_MAX_VIDEO_BYTES": "9"}).max_video_bytes == 9


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_a_decode_mirror_share_that_is_not_a_finite_non_negative_number_is_refused_at_start(value):
    with pytest.raises(ValueError, match="TGI_VLM_DECODE_MIRROR"):
        EngineConfig.from_env({"TGI_VLM_DEVICE": "cpu", "TGI_VLM_DECODE_MIRROR": value})


def test_a_malformed_number_names_the_variable():
    with pytest.raises(ValueError, match="TGI_VLM_MAX_IMAGE_BYTES='lots' is not an integer"):
        EngineConfig.from_env({"TGI_VLM_DEVICE": "cpu", "TGI_VLM_MAX_IMAGE_BYTES": "lots"})


def test_gpu_kv_blocks_follow_tgis_rule_less_the_encoder_cache_budget(monkeypatch):
    # (free − (1 − CUDA_MEMORY_FRACTION)·total) × TGI_WIGGLE_ROOM − encoder budget, in whole blocks,
    # plus the blocks of the temporary warmup cache about to be dropped.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60_000, 100_000))  # (free, total) bytes
    config = EngineConfig.from_env({"TGI_VLM_DEVICE": "cuda", "CUDA_MEMORY_FRACTION": "0.9", "TGI_WIGGLE_ROOM": "0.8",
                                    "TGI_VLM_ENCODER_CACHE_MB": str(100 / (1 << 20)), "ATTENTION": "torch"})
    model = SimpleNamespace(device=torch.device("cuda"), config=config, kv_spec=SimpleNamespace(bytes_per_block=1000),
                            ranks=RankAgreement())
    # (60_000 − 0.1 × 100_000) × 0.8 − 100 = 39_900 bytes → 39 blocks, + 3 reclaimable
    assert FlashCausalLM.default_num_blocks(model, reclaimable_blocks=3) == 42
