"""Build hook: generate the gRPC stubs from proto/ into src/tgi_vlm/pb at install time.

The stubs are not committed. Both `pip install .` and `pip install -e .` run build_py,
which calls this before copying the package, so every install has them.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_DIR = ROOT / "proto" / "generate" / "v3"
OUT_DIR = ROOT / "src" / "tgi_vlm" / "pb"


def generate_stubs() -> None:
    from grpc_tools import protoc  # build-time requirement (pyproject [build-system])
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={OUT_DIR}",
        f"--pyi_out={OUT_DIR}",
        f"--grpc_python_out={OUT_DIR}",
        str(PROTO_DIR / "generate.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on proto/generate/v3/generate.proto")
    # protoc writes a top-level import; make it package-relative.
    grpc_file = OUT_DIR / "generate_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(text.replace("import generate_pb2 as", "from . import generate_pb2 as"))


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__; importers get generate_stubs
    setup(cmdclass={"build_py": BuildPyWithStubs})
