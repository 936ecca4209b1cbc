"""The package's layers import downward only (docs/architecture.md), checked three ways:

- direct: no module's own import statements (lazy ones inside functions included) reach into a layer its part
  stays out of;
- at import time, transitively: importing any module of a part loads (through every module and package
  `__init__` its module-level imports reach) none of the layers that part stays out of. Followed statically,
  and the walk is checked against what Python loads for the HTTP front end;
- at run time, for the HTTP front end: after its token counter has counted and tokenized prompts with images,
  the process holds the prompt side of models/ and none of the engine.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "tgi_vlm"

# Layers named by their package (or module) name.
MODELS, LAYERS, GENERATION = "tgi_vlm.models", "tgi_vlm.layers", "tgi_vlm.generation"
SERVER, ROUTER, API, TESTING, BENCH = "tgi_vlm.server", "tgi_vlm.router", "tgi_vlm.api", "tgi_vlm.testing", "tgi_vlm.benchmarking"

# ----- direct imports ------------------------------------------------------------------------------

FORBIDDEN = {
    "generation": (MODELS, SERVER, ROUTER, TESTING, LAYERS, API, BENCH),
    "layers": (MODELS, SERVER, ROUTER, TESTING, GENERATION, API, BENCH),
    "models": (SERVER, ROUTER, TESTING, API, BENCH),
    "server": (ROUTER, TESTING, API, BENCH),
    "router": (TESTING, SERVER, API, BENCH, LAYERS, GENERATION),
    # The HTTP front end sits on the router driver: never the engine, the shard server, fixtures or benchmarks.
    "api": (MODELS, SERVER, LAYERS, GENERATION, TESTING, BENCH),
    # Benchmarks drive the router (and reach models/ for the transformers reference only, below).
    "benchmarking": (SERVER, TESTING, LAYERS, GENERATION),
    "images.py": (MODELS, ROUTER, TESTING, SERVER, API, BENCH),
    # LoRA loading sits on the layers and the models' adapter table; its flag syntax is read by every part.
    "lora": (SERVER, ROUTER, TESTING, API, BENCH, GENERATION),
    "lora/specs.py": ("tgi_vlm.",),
    "blocks.py": ("tgi_vlm.",),
    "media.py": ("tgi_vlm.",),
    # The native kernels are the bottom floor: layers import them, never the reverse.
    "kernels": ("tgi_vlm.models", "tgi_vlm.layers", "tgi_vlm.generation", "tgi_vlm.server", "tgi_vlm.router",
                "tgi_vlm.testing", "tgi_vlm.api"),
    # The torch attention backend is the reference the native paths are tested against: no native code in it.
    "layers/attention/torch_backend.py": ("tgi_vlm.kernels",),
}

# Where a part may reach into a layer it otherwise stays out of (docs/architecture.md, "Layers"):
# part → (guarded prefix, the modules under it that part may import).
ONLY = {
    "router": (MODELS, ("tgi_vlm.models.request_input", "tgi_vlm.models.vlm_intake", "tgi_vlm.models.architectures")),
    "testing": ("tgi_vlm.", ("tgi_vlm.testing", "tgi_vlm.router.requests", "tgi_vlm.images", "tgi_vlm.pb")),
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


def test_of_the_benchmarks_only_the_references_import_models():
    outside = [f"{f.relative_to(SRC)} imports {m}" for f in files_of("benchmarking") for m in sorted(imported_modules(f))
               if m.startswith(MODELS) and "references" not in f.parts]
    assert outside == []


# ----- what importing a part loads -----------------------------------------------------------------

# The prompt side of models/: a request's chunks, the VLM intake functions, media spans and the adapters
# (their modules; the router builds only prompt halves). The package itself loads nothing of the engine.
PROMPT_SIDE = (MODELS, "tgi_vlm.models.request_input", "tgi_vlm.models.vlm_intake", "tgi_vlm.models.media_spans",
               "tgi_vlm.models.architectures")
ENGINE = (LAYERS, GENERATION)

LOADS_NONE_OF = {
    "generation": (MODELS, SERVER, ROUTER, TESTING, LAYERS, API, BENCH),
    "layers": (MODELS, SERVER, ROUTER, TESTING, GENERATION, API, BENCH),
    "models": (SERVER, ROUTER, TESTING, API, BENCH),
    "router": (*ENGINE, SERVER, TESTING, API, BENCH),
    "api": (*ENGINE, SERVER, TESTING, BENCH),
    "testing": (*ENGINE, SERVER, API, BENCH),  # its router.requests import runs router/__init__ (the whole driver)
    "benchmarking": (*ENGINE, SERVER, TESTING, API),
    "images.py": (MODELS, ROUTER, TESTING, SERVER, API, BENCH, *ENGINE),
    "blocks.py": (MODELS, ROUTER, TESTING, SERVER, API, BENCH, *ENGINE),
    "media.py": (MODELS, ROUTER, TESTING, SERVER, API, BENCH, *ENGINE),
}
# Parts that may load models/ only on its prompt side.
PROMPT_SIDE_ONLY = ("router", "api", "testing", "benchmarking")


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def module_file(name: str) -> Path | None:
    base = SRC.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_statements(body: list[ast.stmt]):
    """The statements that run when the module is imported: not function bodies, not `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        if isinstance(node, ast.If):
            yield from import_time_statements(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
        elif isinstance(node, (ast.ClassDef, ast.With)):
            yield from import_time_statements(node.body)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from import_time_statements(block)


def import_time_imports(name: str) -> set[str]:
    """tgi_vlm modules that module `name`'s own import-time statements import (`from pkg import mod` names mod)."""
    path = module_file(name)
    if path is None:
        return set()  # e.g. generated stubs not built: nothing to follow
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in import_time_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}") is not None)
    return {m for m in found if within(m, ("tgi_vlm",))}


def loaded_by(names: list[str]) -> set[str]:
    """Every tgi_vlm module that importing `names` loads: their imports, followed, and every parent package."""
    loaded, todo = set(), list(names)
    while todo:
        name = todo.pop()
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)]
        for module in parents:
            if module not in loaded and (module_file(module) is not None or module == name):
                loaded.add(module)
                todo += sorted(import_time_imports(module) - loaded)
    return loaded


def modules_of(part: str) -> list[str]:
    return [module_name(f) for f in files_of(part)]


@pytest.mark.parametrize("part", sorted(LOADS_NONE_OF))
def test_importing_a_part_loads_no_layer_it_stays_out_of(part):
    loaded = loaded_by(modules_of(part))
    assert sorted(m for m in loaded if within(m, LOADS_NONE_OF[part])) == []


@pytest.mark.parametrize("part", PROMPT_SIDE_ONLY)
def test_of_models_the_driver_its_front_end_fixtures_and_benchmarks_load_only_the_prompt_side(part):
    loaded = loaded_by(modules_of(part))
    assert sorted(m for m in loaded if within(m, (MODELS,)) and not within(m, PROMPT_SIDE)) == []


def test_the_walk_finds_the_engine_where_it_is():
    """The walk is not blind: the shard server's imports do reach the engine and the generated stubs."""
    loaded = loaded_by(["tgi_vlm.server.service", "tgi_vlm.models.flash_causal_lm"])
    assert {"tgi_vlm.layers.attention.torch_backend", "tgi_vlm.generation.grammar", "tgi_vlm.models.sequence",
            "tgi_vlm.pb.generate_pb2"} <= loaded


# ----- the HTTP front end, run in a fresh interpreter ----------------------------------------------

FRONT_END = """
import json, sys
for name in sys.argv[1].split(","):
    __import__(name)
def snapshot():
    return {"tgi_vlm": sorted(m for m in sys.modules if m == "tgi_vlm" or m.startswith("tgi_vlm.")),
            "libraries": sorted(m for m in ("torch", "transformers", "llguidance", "flashinfer") if m in sys.modules)}
imported = snapshot()
from tgi_vlm.images import make_test_image, png_bytes
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.router.tokens import TokenCounter
image = png_bytes(make_test_image(41, 29, seed=1))
for model in sys.argv[2:]:
    for fast in (True, False):
        counter = TokenCounter(model, fast_count=fast)
        chunks = ["hello"] if counter.prompt is None else [image, "hello"]
        counter.count(RequestParams(chunks).to_pb(1))
        counter.tokenize(RequestParams(chunks).to_pb(2))
print(json.dumps({"imported": imported, "counted": snapshot()}))
"""


@pytest.fixture(scope="module")
def front_end() -> dict:
    """What a fresh interpreter holds after importing every api/ module, then after the token counter (as
    `launch` builds it) has counted and tokenized a prompt with an image (a VLM, both ways) and a text prompt."""
    from tgi_vlm.testing import tiny_model_path

    models = [str(tiny_model_path(arch)) for arch in ("qwen2_vl", "llama")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FRONT_END, ",".join(modules_of("api")), *models],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_the_front_end_loads_exactly_what_the_walk_finds_and_no_torch(front_end):
    imported = front_end["imported"]
    assert set(imported["tgi_vlm"]) == loaded_by(modules_of("api"))
    assert imported["libraries"] == []


def test_counting_tokens_in_the_front_end_loads_the_processor_and_the_prompt_side_not_the_engine(front_end):
    counted = front_end["counted"]
    assert [m for m in counted["tgi_vlm"] if within(m, (*ENGINE, SERVER, TESTING, BENCH))] == []
    assert [m for m in counted["tgi_vlm"] if within(m, (MODELS,)) and not within(m, PROMPT_SIDE)] == []
    assert {"tgi_vlm.models.vlm_intake", "tgi_vlm.models.architectures.qwen2_vl"} <= set(counted["tgi_vlm"])
    assert counted["libraries"] == ["torch", "transformers"]  # the processor's tensors; no grammar, no flashinfer
