"""The package's layers import downward only (docs/architecture.md): a lower layer reaching up
into a higher one, or run-time code importing the test fixtures, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "tgi_vlm"

FORBIDDEN = {
    "generation": ("tgi_vlm.models", "tgi_vlm.server", "tgi_vlm.router", "tgi_vlm.testing", "tgi_vlm.layers",
                   "tgi_vlm.api"),
    "layers": ("tgi_vlm.models", "tgi_vlm.server", "tgi_vlm.router", "tgi_vlm.testing", "tgi_vlm.generation",
               "tgi_vlm.api"),
    "models": ("tgi_vlm.server", "tgi_vlm.router", "tgi_vlm.testing", "tgi_vlm.api"),
    "router": ("tgi_vlm.testing", "tgi_vlm.server", "tgi_vlm.api"),
    # The HTTP front end sits on the router driver: never the engine, the shard server or test fixtures.
    "api": ("tgi_vlm.models", "tgi_vlm.server", "tgi_vlm.layers", "tgi_vlm.generation", "tgi_vlm.testing"),
    "images.py": ("tgi_vlm.models", "tgi_vlm.router", "tgi_vlm.testing", "tgi_vlm.server"),
    "blocks.py": ("tgi_vlm.",),
    # The native kernels are the bottom floor: layers import them, never the reverse.
    "kernels": ("tgi_vlm.models", "tgi_vlm.layers", "tgi_vlm.generation", "tgi_vlm.server", "tgi_vlm.router",
                "tgi_vlm.testing", "tgi_vlm.api"),
    # The torch attention backend is the reference the native paths are tested against: no native code in it.
    "layers/attention/torch_backend.py": ("tgi_vlm.kernels",),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files_of(part: str) -> list[Path]:
    target = SRC / part
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


# Where a part may reach into a layer it otherwise stays out of (docs/architecture.md, "Layers"):
# part → (guarded prefix, the modules under it that part may import).
ONLY = {
    "router": ("tgi_vlm.models", ("tgi_vlm.models.intake", "tgi_vlm.models.vlm_intake",
                                  "tgi_vlm.models.architectures")),
    "testing": ("tgi_vlm.", ("tgi_vlm.testing", "tgi_vlm.router.requests", "tgi_vlm.images", "tgi_vlm.pb")),
}


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_import_runs_upward(part):
    files = files_of(part)
    assert files, f"{part} has no modules: the rule checks nothing"
    upward = [f"{f.relative_to(SRC)} imports {m}" for f in files for m in sorted(imported_modules(f))
              if m.startswith(FORBIDDEN[part])]
    assert upward == []


@pytest.mark.parametrize("part", sorted(ONLY))
def test_router_and_testing_import_only_the_modules_the_architecture_names(part):
    guarded, allowed = ONLY[part]
    outside = [f"{f.relative_to(SRC)} imports {m}" for f in files_of(part) for m in sorted(imported_modules(f))
               if m.startswith(guarded) and not m.startswith(allowed)]
    assert outside == []
