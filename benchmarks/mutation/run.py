"""Mutation testing of the modules behind the README's promises (mutmut 3, scoped and sampled).

What it does
    1. Copies src/, tests/ and pyproject.toml (plus a generated [tool.mutmut] section) into one
       scratch directory per group, so the checkout itself is never rewritten.
    2. Lists every mutant mutmut makes for the files in scope, keeps those whose function matches
       the scope's patterns, and keeps a deterministic sample of them (rule below).
    3. Runs `mutmut run <those mutants>`: mutmut runs the group's tests once to learn which tests call which
       function, then, per mutant, only the tests that reach the mutated function (-x, so the first
       failing test kills it). Process isolation is mutmut's fork server (torch and grpc are
       imported before forking, never initialised), PYTHONHASHSEED=0 fixes test order.
    4. Writes a markdown summary: counts per file, and every surviving / timed-out mutant with
       file:line, the function, the mutation's diff and a judgement read from judgements.json
       (keyed by Class.method__mutmut_N + the mutated line, so keys survive moving a function to
       another module; a judgement whose line no longer matches is shown as "(to judge)").

Tool        mutmut 3.8.1 (pip install '.[mutation]' or `pip install mutmut==3.8.1`), pytest 9.
Scope       GROUPS[*]["scope"] below: path -> function patterns (fnmatch on "Class.method" or "function").
            Edit it when code moves (models/flash_causal_lm.py -> models/intake.py, outputs.py):
            the judgements and the sample follow the function name, not the module.
            mutmut mutates only undecorated functions and methods (plus @staticmethod and
            @classmethod): @property bodies, dataclass defaults, module constants and
            @contextmanager functions are never mutated.
Tests       GROUPS below: each group of modules is its own mutmut run with its own tests, chosen
            from the in-process, fast subsets (no shard subprocess: a mutant in a child process
            would not be seen). The VLM tests run only for the image-path group ("vision").
            tests/models/test_vlm_parity.py and test_properties.py (slow), tests/e2e (subprocess
            shards), tests/server/test_real_shard.py and tests/gpu are out.
Sampling    A mutant is kept when sha1("<Class.method>__mutmut_<N>") mod SAMPLE_MOD is 0
            (SAMPLE_MOD=1 keeps all). The key has no module path and no run-dependent state, so the
            before and after runs, and a run after the refactor, draw the same mutants as long as
            the function's own body is unchanged. --sample-mod overrides.
Verdicts    killed: a test failed; survived: every test reaching the function passed;
            timeout: over mutmut's limit ((expected test time + 1 s) x 15 wall seconds);
            no tests: no selected test calls the function.

How to run (from the repository root; takes about an hour on 2 busy cores):
    nice -n 15 .venv/bin/python benchmarks/mutation/run.py --label before \\
        --out benchmarks/results/mutation-before.md
    --dry-run       list the sampled mutants and counts, run nothing
    --max-children  parallel mutant processes (default 1; each test process uses 2 torch threads)
    --workdir       scratch directory (default /tmp/tgi-vlm-mutation-<label>); --resume keeps it
                    and only runs mutants without a verdict (an interrupted run continues)
    --report-only   rewrite the markdown from the verdicts already in --workdir
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
JUDGEMENTS = HERE / "judgements.json"

# Two groups, each its own mutmut run with its own tests: mutmut runs, per mutant, every selected
# test that reaches the mutated function, and the VLM tests (slow) are worth it only for the image path.
# scope: path (relative to the repository root) -> fnmatch patterns over "Class.method" / "function".
GROUPS: dict[str, dict] = {
    "engine": {
        "scope": {
            # generation/: sampling, logits processors, parameter validation, stopping, detokenizer, logprobs
            "src/tgi_vlm/generation/chooser.py": ["*"],
            "src/tgi_vlm/generation/logits_process.py": ["*"],
            "src/tgi_vlm/generation/parameters.py": ["*"],
            "src/tgi_vlm/generation/stopping.py": ["*"],
            "src/tgi_vlm/generation/detokenizer.py": ["*"],
            "src/tgi_vlm/generation/logprobs.py": ["*"],
            "src/tgi_vlm/layers/attention/kv_cache.py": ["*"],
            # request validation (moves to models/intake.py in the planned refactor)
            "src/tgi_vlm/models/flash_causal_lm.py": [
                "FlashCausalLM.make_sequence",
                "FlashCausalLM._slots_for",
                "FlashCausalLM.truncate",
            ],
            # error mapping and refusals before any cached batch is touched. _rpc is left out: it runs
            # at class-definition time, before a mutant is switched on, so its mutants cannot be killed.
            "src/tgi_vlm/server/service.py": [
                "is_out_of_memory",
                "status_for",
                "TextGenerationService._release_suspended",
                "TextGenerationService._check_new_batch",
                "TextGenerationService._prefill",
                "TextGenerationService._filter_batch",
            ],
        },
        "tests": [
            "tests/unit",
            "tests/models/test_text_generation_features.py",
            "tests/models/test_text_parity.py",
            "tests/server/test_server_rpc.py",
            "tests/server/test_faults_real_model.py",
        ],
    },
    "vision": {
        "scope": {
            # image decoding limits and conversion (not the test-image helpers)
            "src/tgi_vlm/images.py": ["decode_image", "to_rgb"],
            "src/tgi_vlm/models/image_spans.py": ["*"],
            "src/tgi_vlm/models/encoder_cache.py": ["*"],
            # masks: causal, sliding window, and bidirectional image blocks (Gemma3, PaliGemma)
            "src/tgi_vlm/layers/attention/metadata.py": ["*"],
        },
        "tests": [
            "tests/unit",
            "tests/models/test_text_generation_features.py",
            "tests/models/test_vlm_inputs.py",
            "tests/models/test_encoder_reuse.py",
        ],
    },
}
SCOPE: dict[str, list[str]] = {p: pats for g in GROUPS.values() for p, pats in g["scope"].items()}
GROUP_OF: dict[str, str] = {p: name for name, g in GROUPS.items() for p in g["scope"]}

SAMPLE_MOD = 4  # keep 1 mutant in SAMPLE_MOD (see "Sampling" above)

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
          -11: "segfault", -9: "segfault", None: "not checked"}


def qualname(mutant: str) -> str:
    """'tgi_vlm.x.xǁCǁm__mutmut_3' -> 'C.m'; 'tgi_vlm.x.x_f__mutmut_3' -> 'f'."""
    mangled = mutant.rpartition(".")[2].partition("__mutmut_")[0]
    if mangled.startswith("xǁ"):
        _, cls, meth = mangled.split("ǁ")
        return f"{cls}.{meth}"
    return mangled[2:]


def stable_key(mutant: str) -> str:
    return f"{qualname(mutant)}__mutmut_{mutant.rpartition('__mutmut_')[2]}"


def sampled(mutant: str, mod: int) -> bool:
    return mod <= 1 or int(hashlib.sha1(stable_key(mutant).encode()).hexdigest(), 16) % mod == 0


def prepare(base: Path) -> None:
    if base.exists():
        shutil.rmtree(base)
    for group in GROUPS:
        prepare_group(base / group, group)


def prepare_group(workdir: Path, group: str) -> None:
    workdir.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "src", workdir / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", workdir / "tests", ignore=ignore)
    if not list((workdir / "src/tgi_vlm/pb").glob("generate_pb2*.py")):
        sys.exit("src/tgi_vlm/pb/generate_pb2*.py missing: install the package (it generates them) first")
    toml = (ROOT / "pyproject.toml").read_text()
    toml += "\n[tool.mutmut]\n" + "\n".join([
        'source_paths = ["src"]',
        f"only_mutate = {json.dumps(sorted(GROUPS[group]['scope']))}",
        f"pytest_add_cli_args_test_selection = {json.dumps(GROUPS[group]['tests'])}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]',
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
    ]) + "\n"
    (workdir / "pyproject.toml").write_text(toml)


def list_mutants(base: Path, mod: int) -> tuple[list[str], dict[str, dict]]:
    """Every mutant of SCOPE's functions (in mutmut's names), the sampled subset, and per-mutant info."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    info: dict[str, dict] = {}
    for path, patterns in SCOPE.items():
        os.chdir(base / GROUP_OF[path])
        reset_config()
        rel = Path(path)
        names = mutate_file_contents(str(rel), rel.read_text()).mutant_names
        for name in names:
            full = get_mutant_name(rel, name)
            q = qualname(full)
            if any(fnmatch.fnmatchcase(q, p) for p in patterns):
                info[full] = {"group": GROUP_OF[path], "path": path, "qualname": q, "key": stable_key(full), "sampled": sampled(full, mod)}
    return [m for m, i in info.items() if i["sampled"]], info


def run_mutmut(workdir: Path, names: list[str], max_children: int) -> int:
    # Tiny models are built once (by the first test that needs them) and shared by both groups.
    tiny = os.environ.get("TGI_VLM_TINY_CACHE") or str(workdir.parent / "tiny-models")
    env = dict(os.environ, PYTHONHASHSEED="0", TGI_VLM_TINY_CACHE=tiny)
    mutmut = Path(sys.executable).with_name("mutmut")
    cmd = [str(mutmut), "run", "--max-children", str(max_children), *names]
    with open(workdir / "mutmut.log", "ab") as log:
        return subprocess.call(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)


def verdicts(base: Path) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for path in SCOPE:
        meta = base / GROUP_OF[path] / "mutants" / (path + ".meta")
        if meta.exists():
            out.update(json.loads(meta.read_text())["exit_code_by_key"])
    return out


def function_lines(path: Path) -> dict[str, tuple[int, int]]:
    tree = ast.parse(path.read_text())
    spans = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spans[node.name] = (node.lineno, node.end_lineno)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    spans[f"{node.name}.{sub.name}"] = (sub.lineno, sub.end_lineno)
    return spans


def diff_of(base: Path, mutant: str, path: str) -> tuple[str, str, str]:
    """(diff body without headers, first removed line, first added line)."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    os.chdir(base / GROUP_OF[path])
    reset_config()
    diff = get_diff_for_mutant(mutant, path=path)
    body = [ln for ln in diff.splitlines() if not ln.startswith(("---", "+++", "@@"))]
    removed = next((ln[1:] for ln in body if ln.startswith("-")), "")
    added = next((ln[1:] for ln in body if ln.startswith("+")), "")
    changed = [ln for ln in body if ln.startswith(("-", "+"))]
    return "\n".join(changed), removed, added


def report(base: Path, label: str, out: Path, info: dict[str, dict], mod: int, wall_s: float | None) -> None:
    codes = verdicts(base)
    judgements = json.loads(JUDGEMENTS.read_text()) if JUDGEMENTS.exists() else {}
    chosen = [m for m, i in info.items() if i["sampled"]]
    status = {m: STATUS.get(codes.get(m), "suspicious") for m in chosen}
    per_file: dict[str, Counter] = defaultdict(Counter)
    for m in chosen:
        per_file[info[m]["path"]][status[m]] += 1
        per_file[info[m]["path"]]["sampled"] += 1
    for i in info.values():
        per_file[i["path"]]["generated"] += 1
    totals = sum(per_file.values(), Counter())
    spans = {p: function_lines(ROOT / p) for p in SCOPE}
    src_lines = {p: (ROOT / p).read_text().splitlines() for p in SCOPE}

    sample_rule = "all mutants" if mod <= 1 else f'1 in {mod}: sha1("<Class.method>__mutmut_<N>") % {mod} == 0'
    lines = [f"# Mutation testing: {label}", ""]
    lines += [
        "Generated by `benchmarks/mutation/run.py` (its header says how to rerun it).", "",
        f"- Tool: mutmut {_mutmut_version()}, pytest, Python {sys.version.split()[0]}; fork-server isolation.",
        f"- Commit: {_git('rev-parse', '--short', 'HEAD')}" + (" (with uncommitted changes)" if _git("status", "--porcelain", "src", "tests") else ""),
        f"- Sampling: {sample_rule}",
        "- Tests: per mutant, mutmut runs (`pytest -x`) only those of its group's tests that call the mutated function:",
    ]
    for name, g in GROUPS.items():
        lines.append(f"  - {name}: `pytest -x -q {' '.join(g['tests'])}`")
    if wall_s is not None:
        lines.append(f"- Wall time of the mutmut run: {wall_s / 60:.1f} min (2 shared CPU cores, other jobs running, nice 15)")
    lines += ["", "## Modules and functions in scope", ""]
    for p, pats in SCOPE.items():
        lines.append(f"- `{p}`: {', '.join(f'`{x}`' for x in pats)}")
    cols = ["generated", "sampled", "killed", "survived", "timeout", "no tests", "suspicious", "segfault", "not checked"]
    lines += ["", "## Counts", "", "| file | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for p in SCOPE:
        lines.append(f"| `{p.removeprefix('src/tgi_vlm/')}` | " + " | ".join(str(per_file[p][c]) for c in cols) + " |")
    lines.append("| **total** | " + " | ".join(f"**{totals[c]}**" for c in cols) + " |")
    tested = totals["killed"] + totals["survived"] + totals["timeout"]
    if tested:
        lines += ["", f"Mutation score (killed + timeout) / (killed + survived + timeout): "
                      f"{(totals['killed'] + totals['timeout']) / tested:.1%}"]

    lines += ["", "## Surviving mutants", "",
              "Each: `file:line` function (stable key), the mutation, and a judgement: *equivalent* (no "
              "observable behaviour changes) or *missing test* (the behaviour a test should pin).", ""]
    to_judge = 0
    for m in sorted((m for m in chosen if status[m] in ("survived", "timeout", "no tests", "suspicious")),
                    key=lambda m: (info[m]["path"], _lineno_key(m, info, spans), m)):
        i = info[m]
        diff, removed, added = diff_of(base, m, i["path"])
        lo, hi = spans[i["path"]].get(i["qualname"], (1, len(src_lines[i["path"]])))
        line = next((n for n in range(lo, hi + 1) if src_lines[i["path"]][n - 1].strip() == removed.strip()), lo)
        j = judgements.get(i["key"])
        if j and j.get("line", "").strip() != added.strip():
            j = None
        verdict = j["judgement"] if j else "(to judge)"
        to_judge += j is None
        tag = "" if status[m] == "survived" else f" **{status[m]}**"
        lines += [f"- `{i['path'].removeprefix('src/')}:{line}` `{i['qualname']}` ({i['key'].rpartition('__')[2]}){tag}: {verdict}",
                  "  ```diff", *("  " + d for d in diff.splitlines()), "  ```"]
    if to_judge:
        lines += ["", f"{to_judge} survivor(s) not judged yet (no entry in benchmarks/mutation/judgements.json)."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    summary = {c: totals[c] for c in cols}
    (base / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def _lineno_key(m, info, spans):
    return spans[info[m]["path"]].get(info[m]["qualname"], (0, 0))[0]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="before")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--sample-mod", type=int, default=SAMPLE_MOD)
    ap.add_argument("--max-children", type=int, default=1)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    workdir = (args.workdir or Path(f"/tmp/tgi-vlm-mutation-{args.label}")).resolve()
    out = (args.out or ROOT / f"benchmarks/results/mutation-{args.label}.md").resolve()

    if not (args.resume or args.report_only):
        prepare(workdir)
    chosen, info = list_mutants(workdir, args.sample_mod)
    per_file = Counter(i["path"] for i in info.values())
    per_file_chosen = Counter(info[m]["path"] for m in chosen)
    for p in SCOPE:
        print(f"{per_file[p]:5d} generated {per_file_chosen[p]:5d} sampled  {p}")
    print(f"{len(info):5d} generated {len(chosen):5d} sampled  total")
    if args.dry_run:
        for m in chosen:
            print(m)
        return
    wall = None
    if not args.report_only:
        todo = chosen
        if args.resume:
            codes = verdicts(workdir)
            todo = [m for m in chosen if codes.get(m) is None]
        start = time.monotonic()
        for group in GROUPS:
            names = [m for m in todo if info[m]["group"] == group]
            if names:
                print(f"{group}: {len(names)} mutants", flush=True)
                rc = run_mutmut(workdir / group, names, args.max_children)
                print(f"{group}: mutmut exited {rc} after {(time.monotonic() - start) / 60:.1f} min", flush=True)
        wall = time.monotonic() - start
        (workdir / "wall_s.txt").write_text(f"{wall:.0f}\n")
        print(f"done after {wall / 60:.1f} min; logs: {workdir}/*/mutmut.log")
    elif (workdir / "wall_s.txt").exists():
        wall = float((workdir / "wall_s.txt").read_text())
    report(workdir, args.label, out, info, args.sample_mod, wall)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
