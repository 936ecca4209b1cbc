"""The HTTP front end's settings: TGI launcher/router flags of the same names (given on the command line)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ApiConfig:
    model_id: str
    hostname: str = "127.0.0.1"  # TGI binds 0.0.0.0; a laptop server should not be reachable by default
    port: int = 3000
    max_concurrent_requests: int = 128
    max_best_of: int = 2  # TGI's default: /generate's best_of samples up to this many sequences
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    validation_workers: int = 2  # reported in /info; counting runs on the router's own thread
    payload_limit: int = 2_000_000
    api_key: str | None = None
    max_image_fetch_size: int = 20 * 1024 * 1024  # TGI: 1 GiB; here the shard's own image byte limit
    image_fetch_timeout_s: float = 10.0
    chat_template: str | None = None  # --chat-template FILE's text: replaces the model's template
