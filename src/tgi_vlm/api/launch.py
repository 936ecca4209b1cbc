"""`tgi-vlm launch`: start the shard as TGI's launcher does, warm the router driver up, then serve
TGI's HTTP API (uvicorn) until SIGINT/SIGTERM; then stop serving, stop the router, SIGTERM the shard.

The port is bound only once the model is loaded and warmed up, as TGI's router does; the banner
printed then names the address and what to try first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

import uvicorn

from tgi_vlm.api.app import build_app
from tgi_vlm.api.config import ApiConfig
from tgi_vlm.api.state import ApiState
from tgi_vlm.router.router import RouterConfig
from tgi_vlm.router.session import router_session


@dataclass(frozen=True)
class LaunchConfig:
    api: ApiConfig
    router: RouterConfig
    shard_args: list[str] = field(default_factory=list)
    shard_env: dict[str, str] = field(default_factory=dict)
    shard_uds_path: str | None = None
    graceful_termination_timeout_s: float = 90.0
    log_level: str = "warning"


def check_port(host: str, port: int) -> None:
    """Fail before the model loads, not after, when the address is taken."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None


async def launch(config: LaunchConfig, out: TextIO = sys.stdout) -> None:
    api = config.api
    check_port(api.hostname, api.port)
    print(f"tgi-vlm: loading {api.model_id} (shard, warmup) ...", file=out, flush=True)
    async with router_session(api.model_id, uds_path=config.shard_uds_path, shard_env=config.shard_env,
                              shard_args=config.shard_args, config=config.router) as session:
        state = ApiState.create(api, session.router, session.counter)
        server = _Server(uvicorn.Config(
            build_app(state), host=api.hostname, port=api.port, log_level=config.log_level, access_log=False,
            timeout_graceful_shutdown=config.graceful_termination_timeout_s, lifespan="off"))
        banner = asyncio.create_task(_banner_when_up(server, state, out))
        _stop_on_signals(server)
        try:
            await server.serve()
        finally:
            banner.cancel()
            await state.close()
    print("tgi-vlm: stopped", file=out, flush=True)


class _Server(uvicorn.Server):
    """uvicorn re-raises the signal it caught once it has stopped, which would kill the process before
    the router and the shard are stopped; here the signals only ask the server to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _stop_on_signals(server: uvicorn.Server) -> None:
    """First SIGINT/SIGTERM: finish in-flight requests (up to the grace period); a second: stop now."""

    def stop() -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)


async def _banner_when_up(server: uvicorn.Server, state: ApiState, out: TextIO) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    print(banner(state, f"http://{host if ':' not in host else f'[{host}]'}:{port}"), file=out, flush=True)


def tiny_png_data_uri() -> str:
    """A 16×16 one-colour PNG as a data URI: short enough to paste, a real image for the processor."""
    from PIL import Image

    from tgi_vlm.images import png_bytes

    return "data:image/png;base64," + base64.b64encode(png_bytes(Image.new("RGB", (16, 16), (200, 40, 40)))).decode()


def banner(state: ApiState, url: str) -> str:
    """What to type next: a plain generate, a chat with an image, the OpenAI SDK."""
    auth = f" -H 'Authorization: Bearer {state.config.api_key}'" if state.config.api_key else ""
    image = tiny_png_data_uri() if state.takes_images else None
    chat_content = ('[{"type": "text", "text": "Describe this image."}, '
                    f'{{"type": "image_url", "image_url": {{"url": "{image}"}}}}]' if image else '"Hello!"')
    shard = state.router.shard.info
    lines = [
        f"tgi-vlm: serving {state.config.model_id} on {url} ({shard.dtype} on {shard.device_type}, "
        f"max_input_tokens {state.lengths.max_input_tokens}, max_total_tokens {state.lengths.max_total_tokens})",
        "",
        "Try it:",
        f"  curl {url}/generate{auth} -H 'Content-Type: application/json' \\",
        "    -d '{\"inputs\": \"Hello, my name is\", \"parameters\": {\"max_new_tokens\": 20}}'",
        f"  curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"tgi\", \"max_tokens\": 20, \"messages\": [{{\"role\": \"user\", \"content\": {chat_content}}}]}}'",
        "  python -c \"from openai import OpenAI; "
        f"print(OpenAI(base_url='{url}/v1', api_key='{state.config.api_key or '-'}').chat.completions.create("
        "model='tgi', max_tokens=20, messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)\"",
        "",
        f"Also: {url}/info, {url}/health, {url}/metrics, {url}/docs. Ctrl-C stops the server and the shard.",
    ]
    if state.chat_template.template is None:  # e.g. a GGUF file without tokenizer.chat_template: no chat lines
        lines[5:8] = ["  (no chat template in this model: /v1/chat/completions answers a template error; use "
                      "/generate, or /v1/completions, or give one with --chat-template FILE)"]
    if image:
        lines.insert(-2, "  (images: markdown ![](data:image/png;base64,...) or ![](https://...) in /generate inputs, "
                        "image_url parts in chat)")
    return "\n".join(lines)
