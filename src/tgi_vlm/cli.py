"""Command line: `serve` and `download-weights` as TGI's launcher calls them; `launch` (TGI's HTTP API),
`generate`, `bench`, `tiny-model` and `quantized-copy`.

Heavy imports (torch, transformers, the engine) happen inside the commands, after the cheap
checks, so a refused flag fails fast and `--help` stays quick.
"""

# No `from __future__ import annotations`: typer reads the annotations at runtime.
import dataclasses
import os
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer
from loguru import logger

from tgi_vlm.config import EngineConfig, ServerConfig
from tgi_vlm.log import setup_logging
from tgi_vlm.lora.specs import parse_lora_adapters

if TYPE_CHECKING:
    from tgi_vlm.models.types import ShardModel

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="tgi-vlm: a vision-language-model shard for text-generation-inference (TGI v3 protocol).",
)

# Besides weights: config, processor and tokenizer files (and chat templates) of a checkpoint.
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "tokenizer*"]


class Dtype(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


DTYPE_HELP = ("Model dtype (default: bfloat16 on a CPU with AMX / AVX512-BF16, else float32; on a GPU, TGI's "
              "per-architecture float16 / bfloat16)")


def dtype_args(dtype: Optional[Dtype]) -> list[str]:
    """`serve` flags for a shard started by generate / bench / launch: --dtype only when given (TGI's launcher)."""
    return ["--dtype", dtype.value] if dtype else []


def lora_args(lora_adapters: Optional[str]) -> list[str]:
    """`serve` flags for the LoRA adapters of a shard started by generate / bench / launch (checked here first)."""
    try:
        parse_lora_adapters(lora_adapters)
    except ValueError as exc:
        _fail(str(exc))
    return ["--lora-adapters", lora_adapters] if lora_adapters else []


def adapter_names(lora_adapters: Optional[str]) -> tuple[str, ...]:
    """The adapter ids of `--lora-adapters` (refused with exit code 1 when malformed)."""
    lora_args(lora_adapters)
    return tuple(spec.id for spec in parse_lora_adapters(lora_adapters))


# TGI's launcher flag (env LORA_ADAPTERS), handed to the shard's `serve`.
LoraAdapters = Annotated[Optional[str], typer.Option(envvar="LORA_ADAPTERS", help="LoRA adapters to load, "
                                                     "id[=path][@revision],... (TGI's syntax)")]


# `tgi-vlm generate/bench/launch --num-shard N`: N ranks of `serve --sharded`, started as TGI's launcher does.
NumShard = Annotated[int, typer.Option(min=1, help="Shard processes (ranks of `serve --sharded`), as TGI's launcher")]


class TinySize(str, Enum):
    tiny = "tiny"
    bench = "bench"


def _fail(message: str) -> NoReturn:
    logger.error(message)
    raise typer.Exit(code=1)


def check_model_id(model_id: str) -> None:
    if ".." in Path(model_id).parts or ".." in model_id.split("/"):
        _fail(f"model id {model_id!r} contains '..'; pass a hub id (org/name) or an absolute directory path")


# TGI's --quantize values this shard takes: what each does here.
QUANTIZE_SUPPORTED = {
    "eetq": "int8 weight-only per output channel, made at load from the float checkpoint",
    "awq": "an AWQ (GEMM, 4-bit) checkpoint, its packed layers kept quantized",
    "gptq": "a GPTQ (4- or 8-bit) checkpoint, its packed layers kept quantized",
    "compressed-tensors": "a compressed-tensors pack-quantized (W4A16 / W8A16) checkpoint, kept quantized",
}
# The rest of TGI's launcher values, and why not (yet).
QUANTIZE_NOT_YET = {
    "marlin": "Marlin-format checkpoints are not supported (a GPTQ/AWQ checkpoint: --quantize gptq|awq or no flag)",
    "exl2": "EXL2 checkpoints are not supported (GPU-only ExLlamaV2 format)",
    "fp8": "fp8 is not supported on this backend", "bitsandbytes": "bitsandbytes is not supported",
    "bitsandbytes-nf4": "bitsandbytes is not supported", "bitsandbytes-fp4": "bitsandbytes is not supported",
}


def quantize_refusal(quantize: str) -> str:
    why = QUANTIZE_NOT_YET.get(quantize, "not one of TGI's --quantize values")
    supported = "; ".join(f"{k}: {v}" for k, v in QUANTIZE_SUPPORTED.items())
    return (f"--quantize {quantize}: {why} (supported: {supported}; a GGUF file, or an AWQ / GPTQ / compressed-tensors "
            "checkpoint, is served quantized as it is without the flag too)")


def unsupported_features(config: ServerConfig, quantize: Optional[str], speculate: Optional[int],
                         kv_cache_dtype: Optional[str]) -> list[str]:
    """Everything asked for that this backend does not do, each with what to do instead."""
    problems = []
    if quantize and quantize not in QUANTIZE_SUPPORTED:
        problems.append(quantize_refusal(quantize))
    if speculate is not None and speculate < 0:
        problems.append(f"--speculate {speculate} must be >= 0 (draft tokens per step)")
    if kv_cache_dtype:
        problems.append(f"--kv-cache-dtype {kv_cache_dtype} is not supported; the KV cache uses the model dtype")
    try:
        adapters = parse_lora_adapters(config.lora_adapters)
    except ValueError as exc:
        problems.append(str(exc))
    else:
        if adapters and config.world_size > 1:
            problems.append(f"--lora-adapters with WORLD_SIZE={config.world_size}: LoRA adapters are served on one "
                            "shard only (their A/B weights are not split across ranks yet); use --num-shard 1")
    return problems


@app.command()
def serve(
    model_id: Annotated[str, typer.Argument(help="Hub id or local directory of the model")],
    revision: Optional[str] = None,
    sharded: bool = False,
    quantize: Optional[str] = None,
    speculate: Optional[int] = None,
    dtype: Annotated[Optional[Dtype], typer.Option(help=DTYPE_HELP)] = None,
    kv_cache_dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    uds_path: str = "/tmp/text-generation-server",
    logger_level: str = "INFO",
    json_output: bool = False,
    otlp_endpoint: Optional[str] = None,
    otlp_service_name: str = "text-generation-inference.server",
    max_input_tokens: Optional[int] = None,
    lora_adapters: Optional[str] = None,
) -> None:
    """Serve the model on unix://{uds-path}-{rank} (TGI v3 shard protocol)."""
    _setup_logging(logger_level, json_output)
    check_model_id(model_id)
    try:
        config = ServerConfig.from_env(
            model_id, engine=EngineConfig(), uds_path=uds_path, sharded=sharded, json_output=json_output,
            logger_level=logger_level, otlp_endpoint=otlp_endpoint, otlp_service_name=otlp_service_name,
            max_input_tokens=max_input_tokens, lora_adapters=lora_adapters,
        )
    except ValueError as exc:
        _fail(str(exc))
    problems = unsupported_features(config, quantize, speculate, kv_cache_dtype)
    if problems:
        _fail("cannot serve: " + "; ".join(problems))
    try:
        # Only now: reading the device imports torch.
        engine = EngineConfig.from_env(dtype=dtype.value if dtype else None, revision=revision,
                                       trust_remote_code=trust_remote_code, speculate=speculate or 0,
                                       rank=config.rank, world_size=config.world_size, quantize=quantize or None,
                                       lora_adapters=parse_lora_adapters(config.lora_adapters))
    except ValueError as exc:
        _fail(str(exc))
    run_server(dataclasses.replace(config, engine=engine))


def run_server(config: ServerConfig) -> None:
    from tgi_vlm.server.serve import ModelThreadBusy, PeerLost
    from tgi_vlm.server.serve import serve as serve_forever

    try:
        serve_forever(config, load_model)
    except PeerLost as exc:
        _fail(str(exc))
    except ModelThreadBusy as exc:  # its thread cannot be stopped, and would keep the interpreter from exiting
        logger.error("{}; exiting without waiting for it", exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except Exception as exc:
        logger.opt(exception=exc).error("shard failed: {}: {}", type(exc).__name__, exc)
        raise typer.Exit(code=1) from None


def load_model(config: ServerConfig) -> "ShardModel":
    from tgi_vlm.models import get_model

    engine = config.engine
    return get_model(config.model_id, engine, revision=engine.revision, trust_remote_code=engine.trust_remote_code)


@app.command("download-weights")
def download_weights(
    model_id: Annotated[str, typer.Argument(help="Hub id or local directory of the model")],
    revision: Optional[str] = None,
    extension: str = ".safetensors",
    auto_convert: bool = True,
    logger_level: str = "INFO",
    json_output: bool = False,
    trust_remote_code: bool = False,
    merge_lora: bool = False,
) -> None:
    """Fetch a hub model's config, tokenizer and safetensors weights; check a local directory."""
    _setup_logging(logger_level, json_output)
    check_model_id(model_id)
    if merge_lora:
        _fail("--merge-lora: merging an adapter into the base weights at download is not supported; serve it with "
              "--lora-adapters, or merge it beforehand (peft's merge_and_unload)")
    if extension != ".safetensors":
        _fail(f"--extension {extension}: only .safetensors weights are loaded")
    local = Path(model_id).expanduser()
    if local.is_dir():
        check_weights_dir(local)
        return
    if model_id.startswith(("/", ".", "~")):
        _fail(f"local model directory {model_id} does not exist")
    check_weights_dir(_snapshot(model_id, revision, trust_remote_code))


def _snapshot(model_id: str, revision: Optional[str], trust_remote_code: bool) -> Path:
    import huggingface_hub

    patterns = HUB_FILE_PATTERNS + (["*.py"] if trust_remote_code else [])
    logger.info("downloading {} (revision {}) from the Hugging Face Hub", model_id, revision or "main")
    try:
        path = huggingface_hub.snapshot_download(repo_id=model_id, revision=revision, allow_patterns=patterns)
    except Exception as exc:
        _fail(f"could not download {model_id!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
              "Check the id and your network or token (HF_TOKEN); offline, pass a local directory "
              "or set HF_HUB_OFFLINE=1 with the model already in the cache.")
    return Path(path)


def check_weights_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        _fail(f"{path} has no config.json; is it a transformers model directory?")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.glob("*.bin"))
        found = f" (found {', '.join(pickles)}: pickle .bin weights are not loaded)" if pickles else ""
        _fail(f"{path} has no *.safetensors weights{found}; convert the checkpoint to safetensors")
    logger.info("model files present in {}", path)


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Directory to write the model to")],
    arch: Annotated[str, typer.Option(help="model_type of the architecture, e.g. qwen2_vl")],
    size: TinySize = TinySize.tiny,
    logger_level: str = "INFO",
) -> None:
    """Write a small random-weight model of one architecture (offline), for tests and benchmarks."""
    _setup_logging(logger_level, False)
    from tgi_vlm.testing import build_tiny_model

    build_tiny_model(arch, out, size=size.value)
    logger.info("wrote a {} {} model to {}", size.value, arch, out)


class PackedMethod(str, Enum):
    compressed_tensors = "compressed-tensors"
    gptq = "gptq"
    awq = "awq"


@app.command("quantized-copy")
def quantized_copy(
    src: Annotated[Path, typer.Argument(help="A float model directory (e.g. one `tiny-model --size bench` wrote)")],
    out: Annotated[Path, typer.Argument(help="Directory to write the quantized copy to")],
    method: PackedMethod = PackedMethod.compressed_tensors,
    bits: int = 4,
    group: Annotated[int, typer.Option(help="Inputs per scale; -1: one per output row")] = 128,
    symmetric: Annotated[bool, typer.Option(help="No zero points (AWQ always has them)")] = True,
    act_order: Annotated[bool, typer.Option(help="GPTQ desc_act: groups in a permuted input order, with g_idx")] = False,
    logger_level: str = "INFO",
) -> None:
    """Write a 4/8-bit copy of a model's language model as compressed-tensors W4A16 (pack-quantized), GPTQ or AWQ
    (round-to-nearest; vision tower, projector, embedding and lm-head kept), for benchmarks against peers that load
    these formats."""
    _setup_logging(logger_level, False)
    from tgi_vlm.testing.quantized_checkpoints import write_quantized_copy

    write_quantized_copy(src, out, method.value, bits=bits, group=group,
                         symmetric=symmetric and method != PackedMethod.awq, act_order=act_order)
    logger.info("wrote a {} {}-bit group {} copy of {} to {}", method.value, bits, group, src, out)


def _setup_logging(level: str, json_output: bool) -> None:
    try:
        setup_logging(level, json_output)
    except ValueError as exc:
        setup_logging("INFO", json_output)
        _fail(str(exc))


@app.command()
def generate(
    model_id: Annotated[str, typer.Argument(help="Hub id or local directory of the model")],
    num_shard: NumShard = 1,
    image: Annotated[Optional[list[Path]], typer.Option(help="Image file (repeatable); images come before the prompt")] = None,
    video: Annotated[Optional[list[Path]], typer.Option(help="Video file (repeatable; Qwen2-VL / Qwen2.5-VL); clips come "
                                                             "after the images, before the prompt")] = None,
    prompt: Annotated[Optional[str], typer.Option(help="Prompt text")] = None,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    do_sample: bool = False,
    ignore_eos: bool = False,
    uds_path: Annotated[Optional[str], typer.Option(help="Use the shard on this socket (or {path}-0) if it exists; "
                                                         "otherwise start one there")] = None,
    demo: Annotated[bool, typer.Option(help="A built-in prompt and a generated test image")] = False,
    prefix_caching: Annotated[bool, typer.Option(help="The router driver's prefix cache")] = True,
    dtype: Annotated[Optional[Dtype], typer.Option(help=DTYPE_HELP)] = None,
    lora_adapters: LoraAdapters = None,
    adapter_id: Annotated[str, typer.Option(help="The LoRA adapter (of --lora-adapters) this request runs with; "
                                                 "empty: the base model")] = "",
    logger_level: str = "WARNING",
) -> None:
    """Start a shard (as TGI's launcher does), stream one request's tokens, print timings, stop the shard."""
    import asyncio

    _setup_logging(logger_level, False)
    from tgi_vlm.media import VideoBytes

    images = [p.read_bytes() for p in image or []] if not demo else []
    images += [VideoBytes(p.read_bytes(), "video/" + (p.suffix.lstrip(".") or "mp4")) for p in video or []]
    if demo:
        from tgi_vlm.router.generate import DEMO_PROMPT, demo_image

        images, prompt = [demo_image()], prompt or DEMO_PROMPT
    if not prompt and not images:
        _fail("give --prompt (and --image / --video files), or --demo")
    from tgi_vlm.router.generate import generate as run_generate
    from tgi_vlm.router.generate import timing_lines
    from tgi_vlm.router.requests import RequestParams
    from tgi_vlm.router.router import RouterConfig

    params = RequestParams(chunks=[*images, prompt or ""], max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample, ignore_eos=ignore_eos,
                           adapter_id=adapter_id)
    shard_args = [*dtype_args(dtype), *lora_args(lora_adapters)]
    try:
        config = RouterConfig(prefix_caching=prefix_caching, num_shard=num_shard)
        result = asyncio.run(run_generate(model_id, params, uds_path=uds_path, config=config, shard_args=shard_args))
    except (OSError, RuntimeError, TimeoutError) as exc:  # OSError: no such model (transformers' loaders)
        _fail(f"{type(exc).__name__}: {exc}")
    for line in timing_lines(result):
        typer.echo(line)
    if not result.final.ok:
        _fail(f"generation failed: {result.final.error}")


@app.command()
def launch(
    model_id: Annotated[str, typer.Argument(help="Hub id or local directory of the model")],
    num_shard: NumShard = 1,
    port: Annotated[int, typer.Option("--port", "-p", help="HTTP port (0: any free port)")] = 3000,
    hostname: Annotated[str, typer.Option(help="Address to listen on (TGI's default is 0.0.0.0)")] = "127.0.0.1",
    max_concurrent_requests: int = 128,
    max_best_of: Annotated[int, typer.Option(min=1, help="Largest best_of of /generate (sequences sampled, the "
                                                         "best returned)")] = 2,
    max_stop_sequences: int = 4,
    max_top_n_tokens: int = 5,
    max_input_tokens: Annotated[Optional[int], typer.Option(help="Default: max-total-tokens - 1")] = None,
    max_input_length: Annotated[Optional[int], typer.Option(help="Legacy name of --max-input-tokens")] = None,
    max_total_tokens: Annotated[int, typer.Option(help="Prompt + new tokens per request")] = 2048,
    max_batch_prefill_tokens: Annotated[Optional[int], typer.Option(help="Default: max-input-tokens + 50")] = None,
    max_batch_total_tokens: Annotated[Optional[int], typer.Option(help="Default: what the shard's KV cache holds")] = None,
    max_batch_size: Optional[int] = None,
    waiting_served_ratio: float = 0.3,
    max_waiting_tokens: int = 20,
    max_client_batch_size: int = 4,
    validation_workers: int = 2,
    dtype: Annotated[Optional[Dtype], typer.Option(help=DTYPE_HELP)] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="API_KEY", help="Require 'Authorization: Bearer KEY'")] = None,
    payload_limit: Annotated[int, typer.Option(help="Largest request body, bytes")] = 2_000_000,
    max_image_fetch_size: Annotated[int, typer.Option(help="Largest image fetched from a URL, bytes")] = 20 * 1024 * 1024,
    image_fetch_timeout: Annotated[float, typer.Option(help="Seconds allowed for one image URL fetch")] = 10.0,
    shard_uds_path: Annotated[Optional[str], typer.Option(help="Use the shard on this socket (or {path}-0) if it "
                                                                   "exists; otherwise start one there")] = None,
    graceful_termination_timeout: Annotated[float, typer.Option(help="Seconds in-flight requests get on SIGTERM")] = 90.0,
    chat_template: Annotated[Optional[Path], typer.Option(help="A Jinja chat template file for /v1/chat/completions "
                                                               "(replaces the model's own; for models without one)")] = None,
    lora_adapters: LoraAdapters = None,
    logger_level: str = "WARNING",
) -> None:
    """Serve TGI's HTTP API (/generate, /v1/chat/completions, /info, /metrics, ...) from a shard started
    as TGI's launcher does, through the Python router driver. Needs the `server` extra."""
    import asyncio

    _setup_logging(logger_level, False)
    check_model_id(model_id)
    try:
        from tgi_vlm.api.config import ApiConfig
        from tgi_vlm.api.launch import LaunchConfig
        from tgi_vlm.api.launch import launch as run_launch
    except ImportError as exc:
        _fail(f"the HTTP server needs the `server` extra ({exc.name} is missing): pip install 'tgi-vlm[server]'")
    from tgi_vlm.router.router import RouterConfig

    input_tokens = max_input_tokens or max_input_length or max_total_tokens - 1
    if input_tokens >= max_total_tokens:
        _fail(f"--max-input-tokens ({input_tokens}) must be < --max-total-tokens ({max_total_tokens})")
    api = ApiConfig(model_id, hostname=hostname, port=port, max_concurrent_requests=max_concurrent_requests,
                    max_best_of=max_best_of, chat_template=_read_chat_template(chat_template),
                    max_stop_sequences=max_stop_sequences, max_top_n_tokens=max_top_n_tokens,
                    max_client_batch_size=max_client_batch_size, validation_workers=validation_workers,
                    payload_limit=payload_limit, api_key=api_key, max_image_fetch_size=max_image_fetch_size,
                    image_fetch_timeout_s=image_fetch_timeout)
    router = RouterConfig(max_input_tokens=input_tokens, max_total_tokens=max_total_tokens,
                          max_batch_prefill_tokens=max_batch_prefill_tokens or input_tokens + 50,
                          max_batch_total_tokens=max_batch_total_tokens, max_batch_size=max_batch_size,
                          waiting_served_ratio=waiting_served_ratio, max_waiting_tokens=max_waiting_tokens,
                          num_shard=num_shard)
    shard_args = ["--max-input-tokens", str(input_tokens), *dtype_args(dtype), *lora_args(lora_adapters)]
    config = LaunchConfig(api, router, shard_args=shard_args, shard_uds_path=shard_uds_path,
                          graceful_termination_timeout_s=graceful_termination_timeout,
                          log_level=logger_level.lower())
    try:
        asyncio.run(run_launch(config))
    except KeyboardInterrupt:
        pass
    except (OSError, RuntimeError, TimeoutError) as exc:  # OSError: port taken, no such model
        _fail(f"{type(exc).__name__}: {exc}")


def _read_chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"--chat-template {path}: cannot read it ({exc})")


@app.command()
def bench(
    model_id: Annotated[str, typer.Argument(help="Hub id or local directory of the model")],
    num_shard: NumShard = 1,
    num_requests: int = 64,
    images_per_request: int = 1,
    image_min: Annotated[int, typer.Option(help="Smallest image side, pixels")] = 64,
    image_max: Annotated[int, typer.Option(help="Largest image side, pixels")] = 448,
    prompt_min: Annotated[int, typer.Option(help="Shortest prompt, text tokens")] = 16,
    prompt_max: int = 128,
    output_min: Annotated[int, typer.Option(help="Fewest new tokens")] = 16,
    output_max: int = 64,
    concurrency: Annotated[int, typer.Option(help="Requests in flight (closed loop)")] = 16,
    rate: Annotated[Optional[float], typer.Option(help="Poisson arrivals per second instead of --concurrency")] = None,
    seed: int = 0,
    hf: Annotated[bool, typer.Option(help="Also run the workload through transformers generate (static batches)")] = True,
    hf_batch_size: Annotated[Optional[int], typer.Option(help="Static batch size (default: --concurrency)")] = None,
    max_batch_prefill_tokens: int = 2048,
    max_input_tokens: int = 1024,
    max_total_tokens: int = 2048,
    profile: Annotated[bool, typer.Option(help="Sample the shard with py-spy (if installed)")] = False,
    uds_path: Optional[str] = None,
    url: Annotated[Optional[str], typer.Option(help="Send the workload to a running `tgi-vlm launch` (or TGI) at "
                                                    "this URL, over HTTP, instead of driving a shard")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="API_KEY", help="Bearer token for --url")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Requests run their full length (off: greedy outputs may end "
                                                  "at EOS; needed with --url, which has no ignore_eos)")] = True,
    out_dir: Path = Path("benchmarks/results"),
    name: Optional[str] = None,
    logger_level: str = "WARNING",
    workload: Annotated[str, typer.Option(help="synthetic (vs transformers) | video (a clip per request, vs "
                                                   "transformers) | multiturn | shared-prefix "
                                                   "(the last two: prefix caching off vs on)")] = "synthetic",
    prefix_caching: Annotated[bool, typer.Option(help="The router driver's prefix cache (synthetic workload)")] = True,
    system_tokens: Annotated[int, typer.Option(help="Shared system prompt, tokens (shared-prefix: default 256)")] = 0,
    conversations: Annotated[int, typer.Option(help="multiturn: conversations run concurrently")] = 16,
    turns: Annotated[int, typer.Option(help="multiturn: turns per conversation (sequential)")] = 4,
    dtype: Annotated[Optional[Dtype], typer.Option(help=DTYPE_HELP + "; with --url: what that server runs, "
                                                   "for the transformers reference")] = None,
    target: Annotated[Optional[str], typer.Option(help="driver (the router driver against a shard) | http (a "
                                                       "running launch at --url); default: http with --url, "
                                                       "else driver")] = None,
    lora_adapters: Annotated[Optional[str], typer.Option(envvar="LORA_ADAPTERS", help="LoRA adapters for the shard "
                                                         "(TGI's syntax); requests take the base model and each "
                                                         "adapter in turn")] = None,
) -> None:
    """Serving benchmark: a synthetic image+text workload through the router and shard (or over HTTP to a
    running launch, --url), vs transformers; or (--workload multiturn / shared-prefix) the driver's prefix
    cache off vs on."""
    _setup_logging(logger_level, False)
    from tgi_vlm.benchmarking.options import BenchError, BenchOptions, WorkloadOptions
    from tgi_vlm.benchmarking.run import run_bench
    from tgi_vlm.router.router import RouterConfig

    load = WorkloadOptions(num_requests=num_requests, images_per_request=images_per_request, image_min=image_min,
                           image_max=image_max, prompt_min=prompt_min, prompt_max=prompt_max, output_min=output_min,
                           output_max=output_max, concurrency=concurrency, rate=rate, seed=seed, ignore_eos=ignore_eos,
                           system_tokens=system_tokens, conversations=conversations, turns=turns,
                           adapters=adapter_names(lora_adapters))
    if lora_adapters and hf:
        _fail("--lora-adapters: the transformers reference runs the base model only; pass --no-hf")
    router = RouterConfig(max_input_tokens=max_input_tokens, max_total_tokens=max_total_tokens,
                          max_batch_prefill_tokens=max_batch_prefill_tokens, prefix_caching=prefix_caching,
                          num_shard=num_shard)
    options = BenchOptions(model_id, workload=workload, target=target, load=load, router=router, uds_path=uds_path,
                           shard_args=(*dtype_args(dtype), *lora_args(lora_adapters)), url=url, api_key=api_key,
                           dtype=dtype.value if dtype else None, hf=hf, hf_batch_size=hf_batch_size, profile=profile,
                           out_dir=out_dir, name=name)
    try:
        outcome = run_bench(options)
    except BenchError as exc:
        _fail(str(exc))
    from rich.console import Console

    for table in outcome.tables:
        Console(width=140).print(table)
    for line in outcome.lines:
        typer.echo(line)
    for path in outcome.written:
        typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
