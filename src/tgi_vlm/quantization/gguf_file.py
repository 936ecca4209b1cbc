"""Whether a model path is a GGUF file, and how transformers is told to read it (no torch: the router imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class GgufLoadError(ValueError):
    """A GGUF file this shard cannot serve as it is; the message names the file and the tensor."""


@dataclass(frozen=True)
class GgufFile:
    path: Path

    @classmethod
    def find(cls, model_id: str | Path) -> GgufFile | None:
        """The GGUF file `model_id` names: the file itself, or the only `.gguf` in a directory without safetensors
        weights (a directory with several is refused: name the one to serve)."""
        path = Path(model_id)
        if path.is_file():
            return cls(path) if path.suffix == ".gguf" else None
        if not path.is_dir() or any(path.glob("*.safetensors")):
            return None
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GgufLoadError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): "
                                "pass the path of the one to serve")
        return cls(files[0]) if files else None

    def pretrained_args(self) -> tuple[str, dict]:
        """`from_pretrained`'s first argument and keywords for this file."""
        return str(self.path.parent), {"gguf_file": self.path.name}

    def reader(self):
        import gguf

        try:
            return gguf.GGUFReader(self.path)
        except Exception as error:  # the reader's own errors: a truncated file, a bad magic, a bad offset
            raise GgufLoadError(f"{self.path}: not a readable GGUF file ({type(error).__name__}: {error})") from error


def pretrained_source(model_id: str) -> tuple[str, dict]:
    """`from_pretrained`'s first argument and extra keywords for `model_id`: a GGUF file's directory and
    `gguf_file=`, or `model_id` itself and nothing."""
    found = GgufFile.find(model_id)
    return found.pretrained_args() if found is not None else (model_id, {})
