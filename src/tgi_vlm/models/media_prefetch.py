"""Decoding a batch's videos on worker threads, off the model thread.

When a Prefill batch arrives (`FlashCausalLMBatch.from_pb`), `start` submits every chunk whose kind
decodes off-thread (`vlm_intake.Decoder.off_thread`: videos) to a small pool; the model thread goes on
tokenizing the batch and takes each request's results in prompt order (`take`). PyAV releases the GIL
while it decodes and converts frames, so a batch's clips decode in parallel, and a clip's wall time is
bounded by its own deadline (`InputLimits.video_decode_timeout_s`, checked inside the decoder).

Lifetime: the futures of one batch live until its requests are tokenized (`take` pops them); `start`
for the next batch drops whatever a refused request left behind.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from tgi_vlm.config import InputLimits
from tgi_vlm.models.architectures.base import VlmPrompt
from tgi_vlm.models.request_input import MediaChunk, request_chunks
from tgi_vlm.models.vlm_intake import DECODERS, decode_item
from tgi_vlm.pb import generate_pb2


class MediaPrefetch:
    def __init__(self, prompt: VlmPrompt, limits: InputLimits, threads: int = 2):
        self.prompt = prompt
        self.limits = limits
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None  # made on first use: text and image servers never start one
        self._pending: dict[int, dict[int, Future]] = {}  # request id → chunk position → future

    def start(self, requests) -> None:
        """Submit the off-thread chunks of every request; the first request of a duplicated id wins (the
        others are refused at intake)."""
        for futures in self._pending.values():
            for future in futures.values():
                future.cancel()
        self._pending = {}
        for request in requests:
            if request.id not in self._pending:
                self._pending[request.id] = self._submit(request)

    def take(self, request: generate_pb2.Request) -> dict[int, Future]:
        """The request's futures by chunk position (empty when none were started)."""
        return self._pending.pop(request.id, {})

    def _submit(self, request: generate_pb2.Request) -> dict[int, Future]:
        futures, per_kind = {}, Counter()
        for position, chunk in enumerate(request_chunks(request)):
            if not isinstance(chunk, MediaChunk) or not DECODERS[chunk.kind].off_thread:
                continue
            per_kind[chunk.kind] += 1
            if chunk.kind not in self.prompt.media_kinds or per_kind[chunk.kind] > \
                    DECODERS[chunk.kind].max_per_request(self.limits):
                continue  # refused at intake, naming the kind or the count: never decoded
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="tgi-vlm-media")
            futures[position] = self._pool.submit(decode_item, self.prompt, DECODERS[chunk.kind], chunk.data,
                                                  self.limits)
        return futures
