"""The warmup request TGI's v3 router sends (`backends/v3/src/client/sharded_client.rs::warmup`)."""

from __future__ import annotations

import base64
import io

from PIL import Image

from tgi_vlm.pb import generate_pb2 as pb


def warmup_image() -> bytes:
    """A 20×20 PNG, as TGI's router sends (labelled image/jpeg;base64: shards sniff the bytes)."""
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 120, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


def warmup_request(max_input_tokens: int, max_prefill_tokens: int, max_total_tokens: int,
                   max_batch_size: int | None = None) -> pb.WarmupRequest:
    """Requests of "_test " × max_input_tokens (truncated) filling max_prefill_tokens; an image after the first."""
    image = warmup_image()
    requests: list[pb.Request] = []
    n_tokens = 0
    while n_tokens < max_prefill_tokens:
        truncate = min(max_input_tokens, max_prefill_tokens - n_tokens)
        text = "_test " * max_input_tokens
        chunks = [pb.InputChunk(text=text)]
        inputs = text
        if n_tokens == 0:
            chunks.append(pb.InputChunk(image=pb.Image(data=image, mimetype="image/jpeg;base64")))
            inputs += f"![](data:image/jpeg;base64,{base64.b64encode(image).decode()})"
        requests.append(pb.Request(
            id=0,
            inputs=inputs,
            input_chunks=pb.Input(chunks=chunks),
            truncate=truncate,
            add_special_tokens=True,
            prefill_logprobs=True,
            top_n_tokens=20,
            parameters=pb.NextTokenChooserParameters(
                temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=False, seed=0,
                repetition_penalty=1.2, frequency_penalty=0.1, watermark=True,
            ),
            stopping_parameters=pb.StoppingCriteriaParameters(
                max_new_tokens=max_total_tokens - truncate, ignore_eos_token=True
            ),
        ))
        n_tokens += max_input_tokens
        if max_batch_size is not None and len(requests) >= max_batch_size:
            break
    batch = pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input_tokens, max_blocks=0)
    return pb.WarmupRequest(batch=batch, max_input_tokens=max_input_tokens, max_prefill_tokens=max_prefill_tokens,
                            max_total_tokens=max_total_tokens)
