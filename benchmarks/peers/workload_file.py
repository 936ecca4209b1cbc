"""The workload file both sides of the peer comparison read: `tgi-vlm bench`'s requests, written once by
the project's interpreter (`export_workload.py`) and replayed by a peer engine in its own virtualenv
(`vllm_runner.py`), which must not import tgi_vlm. Standard library only, for that reason.

A workload is a directory:
    workload.json   format, model, spec, digest, the warm-up request and the requests
    images/*.png    every image exactly as `tgi-vlm bench` sends it (PNG bytes)

Each request holds the prompt text laid out as tgi-vlm's architecture adapter lays it out (the image
placeholders in place, no chat template), its images (file, sha256, width x height), `max_new_tokens`, and
`prompt_token_ids`: the ids tgi-vlm's shard computes for it (image placeholders expanded), so that the peer
can check its own tokenization against ours. The digest covers all of that, image bytes included (through
their sha256); `read_workload` re-hashes every image and recomputes the digest, so a reader that accepts
the file runs exactly the requests that were written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = 1
MANIFEST = "workload.json"


@dataclass(frozen=True)
class ImageFile:
    file: str  # relative to the workload directory
    sha256: str
    size: tuple[int, int]  # width, height


@dataclass(frozen=True)
class PeerRequest:
    prompt: str
    images: list[ImageFile]
    max_new_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)  # tgi-vlm's; empty when not known (warm-up)


@dataclass(frozen=True)
class Workload:
    directory: Path
    model: str  # the model directory's name (no local paths)
    model_type: str
    spec: dict  # tgi_vlm.benchmarking.synthetic.WorkloadSpec.to_dict()
    digest: str
    warmup: PeerRequest
    requests: list[PeerRequest]

    def image_bytes(self, image: ImageFile) -> bytes:
        return (self.directory / image.file).read_bytes()


class WorkloadError(ValueError):
    """The workload directory is missing, of another format, or does not match its digest."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def workload_digest(warmup: PeerRequest, requests: list[PeerRequest]) -> str:
    """16 hex digits of sha256 over the canonical JSON of every request (image hashes included)."""
    body = json.dumps({"warmup": asdict(warmup), "requests": [asdict(r) for r in requests]},
                      sort_keys=True, separators=(",", ":"))
    return sha256(body.encode())[:16]


def write_workload(directory: Path, *, model: str, model_type: str, spec: dict,
                   warmup: tuple[str, list[bytes], int], requests: list[tuple[str, list[bytes], int, list[int]]]
                   ) -> Workload:
    """Write images and manifest. `warmup`: (prompt, images, max_new_tokens); each request adds its
    prompt token ids. Images are (PNG) bytes; their sizes are read back from the PNG header."""
    images_dir = directory / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    for old in images_dir.glob("*.png"):
        old.unlink()

    def store(tag: str, images: list[bytes]) -> list[ImageFile]:
        stored = []
        for k, data in enumerate(images):
            name = f"images/{tag}-{k}.png"
            (directory / name).write_bytes(data)
            stored.append(ImageFile(name, sha256(data), png_size(data)))
        return stored

    prompt, images, n = warmup
    warm = PeerRequest(prompt, store("warmup", images), n)
    reqs = [PeerRequest(prompt, store(f"r{i:04d}", images), n, list(ids))
            for i, (prompt, images, n, ids) in enumerate(requests)]
    digest = workload_digest(warm, reqs)
    manifest = {"format": FORMAT, "model": model, "model_type": model_type, "spec": spec, "digest": digest,
                "warmup": asdict(warm), "requests": [asdict(r) for r in reqs]}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return Workload(directory, model, model_type, spec, digest, warm, reqs)


def read_workload(directory: Path) -> Workload:
    """The workload in `directory`, after checking every image's hash and the digest."""
    path = directory / MANIFEST
    if not path.is_file():
        raise WorkloadError(f"{path} does not exist: write it with export_workload.py (or compare.py)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise WorkloadError(f"{path}: format {manifest.get('format')!r}, this reader knows {FORMAT}")
    warmup = _request(manifest["warmup"])
    requests = [_request(r) for r in manifest["requests"]]
    for where, request in [("warm-up", warmup), *((f"request {i}", r) for i, r in enumerate(requests))]:
        for image in request.images:
            data = (directory / image.file).read_bytes()
            if sha256(data) != image.sha256:
                raise WorkloadError(f"{where}: {image.file} does not match its sha256 in {MANIFEST}")
    digest = workload_digest(warmup, requests)
    if digest != manifest["digest"]:
        raise WorkloadError(f"{path}: the requests hash to {digest}, the manifest says {manifest['digest']}")
    return Workload(directory, manifest["model"], manifest["model_type"], manifest["spec"], digest, warmup, requests)


def _request(raw: dict) -> PeerRequest:
    images = [ImageFile(i["file"], i["sha256"], tuple(i["size"])) for i in raw["images"]]
    return PeerRequest(raw["prompt"], images, raw["max_new_tokens"], list(raw["prompt_token_ids"]))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise WorkloadError("an image is not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
