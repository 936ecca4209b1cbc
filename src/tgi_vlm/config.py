"""The one place where environment variables and CLI flags are read.

TGI's launcher passes configuration through flags and environment variables. `ServerConfig.from_env`
turns both into frozen dataclasses that are handed to constructors; nothing else in the package
reads `os.environ`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tgi_vlm.lora.specs import AdapterSpec

DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32)
KNOWN_ATTENTION = ("torch", "paged", "flashinfer", "flashdecoding")
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what TGI's launcher gives every shard


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not a number") from exc


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc


def parse_cuda_graphs(value: str | None) -> tuple[int, ...]:
    """TGI's CUDA_GRAPHS: a comma list of batch sizes; unset/empty/"0" disables graphs."""
    if value is None or value.strip() in ("", "0"):
        return ()
    sizes = sorted({int(v) for v in value.split(",") if v.strip()}, reverse=True)
    if any(s <= 0 for s in sizes):
        raise ValueError(f"CUDA_GRAPHS={value!r}: batch sizes must be positive")
    return tuple(sizes)  # largest first: captured in this order to share one memory pool


@dataclass(frozen=True)
class InputLimits:
    """Limits on untrusted request content (documented in README, "Limits")."""

    max_images_per_request: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024  # decompression-bomb guard (width*height)
    # Videos (video.py): every limit refuses the clip with a per-request error, except `max_video_frames`, which
    # caps the frame sampler (a long clip is sampled more sparsely, as Qwen's own max_frames does).
    max_videos_per_request: int = 2
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_frames: int = 32  # sampled frames kept per clip (even, for temporal_patch_size 2)
    max_video_source_frames: int = 36_000  # frames in the file (20 min at 30 fps): bounds decoding work
    max_video_seconds: float = 1200.0
    max_video_frame_pixels: int = 4096 * 2160  # per frame, from the stream header: decompression-bomb guard
    max_video_pixels: int = 32 * 1280 * 720  # sampled frames × frame pixels: what decoding holds (×3 bytes)
    video_decode_timeout_s: float = 20.0
    video_fps: float = 2.0  # frames sampled per second of clip (Qwen2-VL's default), within the processor's bounds
    video_codecs: tuple[str, ...] = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg", "ffv1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, overrides: Mapping[str, str] | None = None) -> InputLimits:
        """From `env` (default: this process's environment) with `overrides` on top (a shard's own environment:
        the router driver's token counter must apply the limits the shard it starts will)."""
        env = {**(os.environ if env is None else env), **(overrides or {})}
        codecs = env.get("TGI_VLM_VIDEO_CODECS")
        limits = cls(
            max_images_per_request=_int(env, "TGI_VLM_MAX_IMAGES_PER_REQUEST", cls.max_images_per_request),
            max_image_bytes=_int(env, "TGI_VLM_MAX_IMAGE_BYTES", cls.max_image_bytes),
            max_image_pixels=_int(env, "TGI_VLM_MAX_IMAGE_PIXELS", cls.max_image_pixels),
            max_videos_per_request=_int(env, "TGI_VLM_MAX_VIDEOS_PER_REQUEST", cls.max_videos_per_request),
            max_video_bytes=_int(env, "TGI_VLM_MAX_VIDEO_BYTES", cls.max_video_bytes),
            max_video_frames=_int(env, "TGI_VLM_MAX_VIDEO_FRAMES", cls.max_video_frames),
            max_video_source_frames=_int(env, "TGI_VLM_MAX_VIDEO_SOURCE_FRAMES", cls.max_video_source_frames),
            max_video_seconds=_float(env, "TGI_VLM_MAX_VIDEO_SECONDS", cls.max_video_seconds),
            max_video_frame_pixels=_int(env, "TGI_VLM_MAX_VIDEO_FRAME_PIXELS", cls.max_video_frame_pixels),
            max_video_pixels=_int(env, "TGI_VLM_MAX_VIDEO_PIXELS", cls.max_video_pixels),
            video_decode_timeout_s=_float(env, "TGI_VLM_VIDEO_DECODE_TIMEOUT_S", cls.video_decode_timeout_s),
            video_fps=_float(env, "TGI_VLM_VIDEO_FPS", cls.video_fps),
            video_codecs=tuple(c.strip() for c in codecs.split(",") if c.strip()) if codecs else cls.video_codecs,
        )
        if limits.max_video_frames < 1 or limits.video_decode_timeout_s <= 0 or limits.video_fps <= 0:
            raise ValueError(f"video limits must be positive, got {limits}")
        return limits


@dataclass(frozen=True)
class GrammarLimits:
    """Grammar-constrained decoding (README, "Limits"): what a request's grammar may cost.

    A grammar longer than `max_bytes` (UTF-8) or not compiled within `compile_timeout_s` of its
    batch's arrival is refused; the model thread never waits longer than that for one batch's
    grammars. Compiled grammars are kept by content (`cache_entries`, least recently used out).
    `threads` compile grammars (off the model thread) and fill one step's token masks.
    """

    max_bytes: int = 256 * 1024
    compile_timeout_s: float = 2.0
    cache_entries: int = 256
    threads: int = 2

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GrammarLimits:
        limits = cls(
            max_bytes=_int(env, "TGI_VLM_GRAMMAR_MAX_BYTES", cls.max_bytes),
            compile_timeout_s=_float(env, "TGI_VLM_GRAMMAR_COMPILE_TIMEOUT_S", cls.compile_timeout_s),
            cache_entries=_int(env, "TGI_VLM_GRAMMAR_CACHE_ENTRIES", cls.cache_entries),
            threads=_int(env, "TGI_VLM_GRAMMAR_THREADS", cls.threads),
        )
        if limits.max_bytes < 1 or limits.compile_timeout_s <= 0 or limits.cache_entries < 1 or limits.threads < 1:
            raise ValueError(f"grammar limits must be positive, got {limits}")
        return limits


def default_kernel_cache() -> Path:
    return Path.home() / ".cache" / "tgi-vlm" / "kernels"


@dataclass(frozen=True)
class KernelSettings:
    """Which native CPU kernels run (kernels/cpu/: C built on first use where a C compiler is found) and where they
    are built. Each switch turns one kernel off on its own; where a kernel is on but cannot load (no compiler, no
    AVX-512 for decode attention and the skinny linears), its caller runs torch's operations. Turned off, a
    kernel is not built either."""

    # Decode attention from the paged cache (the CPU attention backend); CPU only: EngineConfig.native_attention_on.
    native_attention: bool = True
    native_norm: bool = True  # the lean decoder layer's RMSNorm in one call (layers/cpu_decoder.py)
    native_rotary: bool = True  # the lean layer's rotary + K/V store in one pass (bit-equal to torch's)
    skinny_linear: bool = True  # float32 decode-sized / bf16 few-row linears over a blocked copy (layers/skinny_linear.py)
    cpu_speedups: bool = True  # every CPU rewrite applied at load (layers/cpu.py), the lean layer among them
    kernel_cache_dir: Path = field(default_factory=default_kernel_cache)  # built libraries, keyed by what made them
    cc: str | None = None  # the C compiler command, split as a shell would ("ccache gcc"); None: cc, else gcc

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelSettings:
        env = os.environ if env is None else env
        cache = env.get("TGI_VLM_KERNEL_CACHE")
        return cls(
            native_attention=_flag(env, "TGI_VLM_NATIVE_ATTENTION", True),
            native_norm=_flag(env, "TGI_VLM_NATIVE_NORM", True),
            native_rotary=_flag(env, "TGI_VLM_NATIVE_ROTARY", True),
            skinny_linear=_flag(env, "TGI_VLM_SKINNY_LINEAR", True),
            cpu_speedups=_flag(env, "TGI_VLM_CPU_SPEEDUPS", True),
            kernel_cache_dir=Path(cache) if cache else default_kernel_cache(),
            cc=env.get("CC") or None,
        )


@dataclass(frozen=True)
class EngineConfig:
    """What the model runner needs: device, dtype, attention, KV cache and generation knobs."""

    device: str = "cpu"
    dtype: str | None = None  # --dtype; None: tgi_vlm.dtypes' default rule, resolved when the model loads
    attention: str = "torch"
    block_size: int = 16
    prefix_caching: bool = False
    prefill_chunking: bool = True
    cuda_graphs: tuple[int, ...] = ()
    cuda_memory_fraction: float = 1.0
    wiggle_room: float = 0.90
    # CPU has no "free memory" to size the KV cache from: a byte budget instead.
    cpu_kv_cache_bytes: int = 1 << 30
    # The CPU attention backend's dense copy of the decoding sequences' K/V (layers/attention/decode_mirror.py),
    # at most this share of the KV cache's bytes; 0 = the reference gather path. None: 0.5 on CPU, 0 on
    # CUDA (whose KV cache takes the free memory, whose default backend is flashinfer, and whose torch backend is
    # the reference, with no mirror).
    decode_mirror: float | None = None
    # The native CPU kernels: which run, where they are built (decode attention: CPU only, native_attention_on).
    kernels: KernelSettings = field(default_factory=KernelSettings)
    request_logprobs: bool = False
    speculate: int = 0  # draft tokens per decoding sequence and step (TGI's --speculate); 0 = off
    # TGI's --quantize, as far as it applies here: None, or "eetq" (int8 weight-only per output channel, at load)
    quantize: str | None = None
    # Tensor parallelism (serve --sharded): this process's rank of world_size; 1 = one unsharded shard.
    rank: int = 0
    world_size: int = 1
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    trust_remote_code: bool = False
    revision: str | None = None
    # Cross-request vision-encoder cache (content-hash LRU), bytes; 0 disables it.
    encoder_cache_bytes: int = 256 << 20
    limits: InputLimits = field(default_factory=InputLimits)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    # LoRA adapters loaded at start (--lora-adapters / LORA_ADAPTERS, parsed by lora/specs.py); () = none.
    lora_adapters: tuple[AdapterSpec, ...] = ()

    @property
    def decode_mirror_share(self) -> float:
        if self.decode_mirror is not None:
            return self.decode_mirror
        return 0.0 if self.device.startswith("cuda") else 0.5

    @property
    def native_attention_on(self) -> bool:
        """CPU only (the kernels are CPU code: `make_backend` gives the CPU attention backend on CPU alone); on unless
        turned off; never on CUDA (flashinfer's job)."""
        return self.kernels.native_attention and self.device.startswith("cpu")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> EngineConfig:
        env = os.environ if env is None else env
        device = overrides.pop("device", None) or env.get("TGI_VLM_DEVICE") or _default_device()
        attention = (env.get("ATTENTION") or ("flashinfer" if device.startswith("cuda") else "torch")).lower()
        if attention not in KNOWN_ATTENTION:
            raise ValueError(f"ATTENTION={attention!r} is not known; choose one of {', '.join(KNOWN_ATTENTION)}")
        values = dict(
            device=device,
            attention=attention,
            block_size=_int(env, "BLOCK_SIZE", 16),
            prefix_caching=_flag(env, "PREFIX_CACHING", False),
            prefill_chunking=_flag(env, "PREFILL_CHUNKING", True),
            cuda_graphs=parse_cuda_graphs(env.get("CUDA_GRAPHS")) if device.startswith("cuda") else (),
            cuda_memory_fraction=_float(env, "CUDA_MEMORY_FRACTION", 1.0),
            wiggle_room=_float(env, "TGI_WIGGLE_ROOM", 0.90),
            cpu_kv_cache_bytes=int(_float(env, "TGI_VLM_CPU_KV_CACHE_GB", 1.0) * (1 << 30)),
            decode_mirror=_float(env, "TGI_VLM_DECODE_MIRROR", None),
            kernels=KernelSettings.from_env(env),
            request_logprobs=_flag(env, "REQUEST_LOGPROBS", False),
            watermark_gamma=_float(env, "WATERMARK_GAMMA", 0.5),
            watermark_delta=_float(env, "WATERMARK_DELTA", 2.0),
            encoder_cache_bytes=int(_float(env, "TGI_VLM_ENCODER_CACHE_MB", 256) * (1 << 20)),
            limits=InputLimits.from_env(env),
            grammar=GrammarLimits.from_env(env),
        )
        values.update(overrides)
        config = cls(**values)
        if config.block_size <= 0:
            raise ValueError(f"BLOCK_SIZE={config.block_size} must be positive")
        mirror = config.decode_mirror
        if mirror is not None and not (math.isfinite(mirror) and mirror >= 0):
            raise ValueError(f"TGI_VLM_DECODE_MIRROR={mirror} must be a share of the KV cache >= 0 (0 turns it off)")
        return config


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ServerConfig:
    """Process-level settings: which model, where to listen, how to log."""

    model_id: str
    uds_path: str = "/tmp/text-generation-server"
    rank: int = 0
    world_size: int = 1
    master_addr: str = "localhost"
    master_port: int = 29500
    sharded: bool = False
    json_output: bool = False
    logger_level: str = "INFO"
    otlp_endpoint: str | None = None
    otlp_service_name: str = "text-generation-inference.server"
    max_input_tokens: int | None = None
    max_message_bytes: int = 2**31 - 1  # images can be megabytes; TGI uses i32::MAX
    lora_adapters: str | None = None  # --lora-adapters or LORA_ADAPTERS, as given (EngineConfig holds them parsed)
    shutdown_grace_s: float = 10.0  # on SIGTERM: how long the in-flight RPC may still run
    # Sharded: how long joining the process group, or one collective, may wait for the other ranks (TGI: 120 s).
    dist_timeout_s: float = 120.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    @classmethod
    def from_env(cls, model_id: str, env: Mapping[str, str] | None = None, *, engine: EngineConfig | None = None,
                 **flags) -> ServerConfig:
        env = os.environ if env is None else env
        flags["lora_adapters"] = flags.get("lora_adapters") or env.get("LORA_ADAPTERS") or None
        missing = [name for name in DISTRIBUTED_ENV if not env.get(name)]
        if flags.get("sharded") and missing:  # as TGI's `serve`, which asserts each of them
            raise ValueError(f"--sharded needs {', '.join(missing)} in the environment (TGI's launcher sets "
                             f"{', '.join(DISTRIBUTED_ENV)} for every shard it starts)")
        config = cls(
            model_id=model_id,
            rank=_int(env, "RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            master_addr=env.get("MASTER_ADDR", "localhost"),
            master_port=_int(env, "MASTER_PORT", 29500),
            max_message_bytes=_int(env, "TGI_VLM_MAX_MESSAGE_BYTES", 2**31 - 1),
            shutdown_grace_s=_float(env, "TGI_VLM_SHUTDOWN_GRACE_S", 10.0),
            dist_timeout_s=_float(env, "TGI_VLM_DIST_TIMEOUT_S", 120.0),
            engine=engine or EngineConfig.from_env(env),
            **flags,
        )
        config.check_sharding()
        return config

    def check_sharding(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}: 0 <= RANK < WORLD_SIZE")
        if self.world_size > 1 and not self.sharded:
            # TGI would bind every rank to {uds}-0; the launcher always passes --sharded with WORLD_SIZE > 1.
            raise ValueError(f"WORLD_SIZE={self.world_size} without --sharded: pass --sharded (TGI's launcher does "
                             "when --num-shard > 1) or set WORLD_SIZE=1")

    def socket_path(self, rank: int | None = None) -> str:
        return f"{self.uds_path}-{self.rank if rank is None else rank}"

    def socket_url(self, rank: int | None = None) -> str:
        return f"unix://{self.socket_path(rank)}"
