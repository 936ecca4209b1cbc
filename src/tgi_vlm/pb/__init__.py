"""Generated gRPC stubs for proto/generate/v3/generate.proto (built at install time, not committed)."""

try:
    # Only the messages: the engine needs no grpc. The server imports generate_pb2_grpc itself.
    from . import generate_pb2  # noqa: F401
except ImportError as exc:  # pragma: no cover - only when the package was copied without installing
    raise ImportError(
        "tgi_vlm.pb stubs are missing: install the package (`pip install .` or `make install`), "
        "which generates them from proto/generate/v3/generate.proto"
    ) from exc
