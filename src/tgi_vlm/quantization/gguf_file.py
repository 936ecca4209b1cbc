"""Whether a model path is a GGUF file, and how transformers is told to read it (no torch: the router imports it)."""

from __future__ import annotations

import struct
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

    def check(self) -> None:
        """Refuse, naming the file (and the tensor), a file that is not whole or not readable, before transformers
        reads it (its errors name neither): a header or tensor table that does not parse, a tensor of a type id the
        gguf package does not know, a tensor whose data runs past the end of the file (a truncated download)."""
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as file:
                data_start, tensors = _tensor_table(file)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError) as error:
            raise GgufLoadError(f"{self.path.name}: not a readable GGUF file, its header or tensor table is damaged "
                                f"or cut short ({type(error).__name__}: {error})") from error
        for name, count, type_id, offset in tensors:
            nbytes = _tensor_bytes(count, type_id)
            if nbytes is None:
                raise GgufLoadError(f"{self.path.name}: tensor {name} has GGUF type id {type_id}, which the gguf "
                                    "package does not know (a newer llama.cpp type?)")
            end = data_start + offset + nbytes
            if end > size:
                raise GgufLoadError(f"{self.path.name}: tensor {name} is cut short: its data ends at byte {end} and "
                                    f"the file has {size} bytes (an incomplete download or copy?)")

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


# GGUF metadata value types (gguf's GGUFValueType): fixed sizes; 8 is a string, 9 an array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _read(file, fmt: str):
    raw = file.read(struct.calcsize(fmt))
    return struct.unpack(fmt, raw)  # struct.error when the file ends first


def _skip_value(file, kind: int) -> None:
    if kind in _FIXED:
        file.seek(_FIXED[kind], 1)
    elif kind == _STRING:
        (length,) = _read(file, "<Q")
        file.seek(length, 1)
    elif kind == _ARRAY:
        item, count = _read(file, "<IQ")
        if item in _FIXED:
            file.seek(_FIXED[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(file, item)
    else:
        raise ValueError(f"unknown metadata value type {kind}")


def _tensor_table(file) -> tuple[int, list[tuple[str, int, int, int]]]:
    """The data section's start and, per tensor, (name, element count, ggml type id, offset in the data section),
    read from the header alone (GGUF v2/v3: magic, version, counts, metadata, tensor infos, aligned data)."""
    if file.read(4) != b"GGUF":
        raise ValueError("no GGUF magic at the start")
    version, tensor_count, kv_count = _read(file, "<IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reader takes 2 and 3)")
    alignment = 32
    for _ in range(kv_count):
        (length,) = _read(file, "<Q")
        key = file.read(length).decode()
        (kind,) = _read(file, "<I")
        if key == "general.alignment" and kind == 4:
            (alignment,) = _read(file, "<I")
        else:
            _skip_value(file, kind)
    tensors = []
    for _ in range(tensor_count):
        (length,) = _read(file, "<Q")
        name = file.read(length).decode()
        (dims,) = _read(file, "<I")
        shape = _read(file, f"<{dims}Q")
        type_id, offset = _read(file, "<IQ")
        count = 1
        for d in shape:
            count *= d
        tensors.append((name, count, type_id, offset))
    position = file.tell()
    return (position + alignment - 1) // alignment * alignment, tensors


def _tensor_bytes(count: int, type_id: int) -> int | None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None
    return count // block * size
