"""Mutation testing of the modules behind the README's promises (mutmut 3, scoped and sampled).

What it does
    1. Copies src/, tests/ and pyproject.toml (plus a generated [tool.mutmut] section) into one
       scratch directory per group, so the checkout itself is never rewritten.
    2. Lists every mutant mutmut makes for the files in scope, keeps those whose function matches
       the scope's patterns, and keeps a deterministic sample of them (rule below).
    3. Runs `mutmut run <those mutants>` per group: mutmut runs the group's tests once to learn
       which tests call which function, then, per mutant, only the tests that reach the mutated
       function (-x: the first failing test kills it). Process isolation is mutmut's fork server
       (torch and grpc are imported before forking, never initialised); PYTHONHASHSEED=0.
    4. Writes a markdown summary: counts per file, and every surviving / timed-out mutant with
       file:line, the function, the mutation's diff and a judgement read from judgements.json
       (keyed by Class.method__mutmut_N and checked against the mutated line, so a judgement
       follows a function moved to another module; one whose line no longer matches shows as
       "(to judge)"), plus notes-<label>.md (the survivors grouped by behaviour) if present.

Widened     Groups "boundaries" (api/validation.py, prefix_hash.py, router/prefix_cache.py, models/encoder_cache.py,
            the native wrappers' checks) and "speculative" (FlashCausalLM's verify-and-accept loop, generation/
            speculative.py) are the widened scope of benchmarks/results/mutation-widened-{before,after}.md; run them
            alone with `--groups boundaries,speculative` (the listing and the report then hold only those groups).
            A test file a group names that the checkout lacks is left out and named in the report (a "before" run
            from an older commit). benchmarks/mutation/planted.py plants, one at a time, the bugs the boundary tests
            were written for and checks each is caught (benchmarks/results/planted-bugs.md).
Tool        mutmut 3.8.1 (pip install '.[mutation]', or `pip install mutmut==3.8.1`), pytest.
Scope       GROUPS[*]["scope"] below: path -> fnmatch patterns over "Class.method" / "function".
            Edit the paths when code moves (the refactor moved FlashCausalLM.make_sequence, _slots_for
            and truncate to module functions of models/intake.py; compare.py matches the "before"
            mutants to their new homes); the sample and the judgements follow the function name, not
            the module. Group "extra" (outputs, prefix caching) was not in the "before" run. mutmut mutates only undecorated functions and methods (and @staticmethod /
            @classmethod ones): @property bodies, dataclass defaults, module constants and
            @contextmanager functions are never mutated.
Tests       GROUPS[*]["tests"]: each group is its own mutmut run with its own tests, chosen from
            the fast in-process subsets. Out: tests/e2e and tests/server/test_real_shard.py (the
            shard runs in a subprocess, which does not see the mutant), test_vlm_parity.py,
            test_properties.py and test_vlm_inputs.py (too slow for the time budget), tests/gpu.
Sampling    A mutant is kept when int(sha1("<Class.method>__mutmut_<N>"), 16) % SAMPLE_MOD == 0
            (SAMPLE_MOD = 8 now; 1 keeps all; --sample-mod overrides). The key holds no module
            path and nothing run-dependent, so before and after runs, and runs after the refactor,
            draw the same mutants while a function's own body is unchanged; the 1-in-16 sample is
            a subset of the 1-in-8 one, and so on.
Verdicts    killed: a test failed; survived: every selected test reaching the function passed;
            timeout: over mutmut's limit ((expected test time + 1 s) x 15, wall seconds);
            no tests: no selected test calls the function.

How to run (from the repository root; ~70 min at 1 in 8 on 2 cores shared with other jobs):
    .venv/bin/pip install mutmut==3.8.1
    nice -n 15 .venv/bin/python benchmarks/mutation/run.py --label after --max-children 2
    writes benchmarks/results/mutation-<label>.md (or --out); scratch in /tmp/tgi-vlm-mutation-<label>
    --dry-run       list the sampled mutants and counts, run nothing
    --max-children  parallel mutant processes (default 1; each test process uses 2 torch threads)
    --groups        groups to run, in order (default all: engine,vision,extra,boundaries,speculative)
    --workdir       scratch directory; --resume keeps it and runs only mutants without a verdict
                    (an interrupted run continues; its earlier wall time is added)
    --report-only   rewrite the markdown from the verdicts already in the scratch directory
Set TGI_VLM_TINY_CACHE to reuse already-built tiny models.
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

# Groups, each its own mutmut run with its own tests: mutmut runs, per mutant, every selected
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
            # request validation: was FlashCausalLM.make_sequence / _slots_for / truncate in
            # models/flash_causal_lm.py; the refactor moved it to module functions in models/intake.py
            "src/tgi_vlm/models/intake.py": [
                "make_sequence",
                "check_request",
                "check_slots",
                "claim_slots",
                "check_cached_prefix",
            ],
            # request_chunks and truncate_ids, moved out of intake.py so the router loads them without the engine
            "src/tgi_vlm/models/request_input.py": ["*"],
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
            "tests/models/test_slot_bounds.py",
            "tests/models/test_sampling_parity.py",
            "tests/models/test_security_defaults.py",
        ],
    },
    "vision": {
        "scope": {
            # image decoding limits and conversion (not the test-image helpers)
            "src/tgi_vlm/images.py": ["decode_image", "to_rgb"],
            "src/tgi_vlm/models/media_spans.py": ["*"],  # models/image_spans.py before the media rename
            # models/encoder_cache.py moved to group "boundaries" (its byte accounting has its own tests there)
            # masks: causal, sliding window, and bidirectional image blocks (Gemma3, PaliGemma)
            "src/tgi_vlm/layers/attention/metadata.py": ["*"],
        },
        "tests": [
            "tests/unit",
            "tests/models/test_text_generation_features.py",
            "tests/models/test_encoder_reuse.py",
            # tests/models/test_vlm_inputs.py (82 VLM tests, ~25 s quiet) is left out to fit the time
            # budget: every mutant of decode_image/_span_mask would run most of it.
        ],
    },
    # Not in the "before" run (reported apart from the like-for-like comparison); runs last.
    "extra": {
        "scope": {
            # per-step outputs (tokens, generations), split out of flash_causal_lm.py by the refactor
            "src/tgi_vlm/models/outputs.py": ["OutputBuilder.*"],
            # prefix caching: the shard's records of KV blocks (prefix_hash.py moved to group "boundaries")
            "src/tgi_vlm/models/prefix_cache.py": ["*"],
        },
        "tests": [
            "tests/unit",
            "tests/models/test_text_generation_features.py",
            "tests/models/test_prefix_caching.py",
        ],
    },
    # The widened scope (benchmarks/results/mutation-widened-*.md): exact limits and bookkeeping whose effect
    # is not a token. In-process tests only; the HTTP front end through its ASGI app, not a launched server.
    "boundaries": {
        "scope": {
            "src/tgi_vlm/api/validation.py": ["*"],  # TGI's request validation: limits at their exact values
            "src/tgi_vlm/prefix_hash.py": ["*"],  # the content-key chain of KV blocks
            "src/tgi_vlm/router/prefix_cache.py": ["*"],  # the driver's prefix cache (refs, index, LRU)
            "src/tgi_vlm/models/encoder_cache.py": ["*"],  # per-request entries and the byte-bounded LRU
            # the checks at the native ops' entry points. The ops themselves are functions decorated by ops._op,
            # which mutmut does not mutate (decorated): their checks live in these helpers, except rotary_and_store's
            # and skinny_linear's inline slot/row checks (planted by hand: benchmarks/mutation/planted.py).
            "src/tgi_vlm/kernels/cpu/ops.py": [
                "slot_bound",
                "_loaded",
                "_cache_problem",
                "_decode_problem",
                "_decode_index_problem",
                "_rotary_problem",
                "_linear_problem",
            ],
            "src/tgi_vlm/layers/attention/cpu_backend.py": ["NativeDecodeStep.*"],  # the step decode_attention gets
        },
        "tests": [
            "tests/unit/test_api.py",
            "tests/unit/test_api_health.py",
            "tests/unit/test_router_prefix_cache.py",
            "tests/unit/test_encoder_cache.py",
            "tests/unit/test_prefix_hash.py",
            "tests/unit/test_cpu_backend.py",
            "tests/unit/test_kernel_ops.py",
            "tests/unit/test_bench_prefix.py",
            "tests/models/test_prefix_caching.py",
            "tests/models/test_encoder_reuse.py",
            # tests/models/test_vlm_prefix_caching.py (7 VLMs) is left out for time: every mutant of the key chain
            # would run it; the unit tests above key images at block edges directly.
            # added with the widened scope
            "tests/unit/test_api_validation_limits.py",
            "tests/unit/test_prefix_key_chain.py",
            "tests/unit/test_encoder_cache_bytes.py",
            "tests/unit/test_native_entry_bounds.py",
            "tests/unit/test_prefix_cache_bookkeeping.py",  # written for the after run's survivors
        ],
    },
    # Speculative decoding's verify-and-accept loop: the llama cases of test_speculative.py (every VLM is
    # ~60 s more per surviving mutant) and the stop/EOS-inside-a-run tests.
    "speculative": {
        "scope": {
            "src/tgi_vlm/models/flash_causal_lm.py": [
                "FlashCausalLM.sample",
                "FlashCausalLM.propose_drafts",
                "SpeculationStats.*",
            ],
            "src/tgi_vlm/generation/speculative.py": ["*"],
        },
        "tests": [
            *(f"tests/models/test_speculative.py::{t}" for t in (
                "test_the_ngram_drafter_proposes_what_followed_the_most_recent_match_of_the_longest_suffix",
                "test_greedy_tokens_and_logprobs_equal_the_plain_run_and_transformers[llama-1]",
                "test_greedy_tokens_and_logprobs_equal_the_plain_run_and_transformers[llama-2]",
                "test_greedy_tokens_and_logprobs_equal_the_plain_run_and_transformers[llama-4]",
                "test_batched_with_chunked_prefill_and_a_join_mid_decode[llama]",
                "test_seeded_sampling_and_stop_conditions_inside_an_accepted_run_match_the_plain_run[llama]",
                "test_info_reports_the_speculation_depth",
                "test_drafts_never_need_slots_beyond_prompt_plus_max_new_tokens[llama]",
            )),
            # added with the widened scope
            "tests/models/test_speculative_stops.py",
            "tests/unit/test_speculative_drafter.py",  # written for the runs' survivors
        ],
    },
}
SCOPE: dict[str, list[str]] = {p: pats for g in GROUPS.values() for p, pats in g["scope"].items()}
GROUP_OF: dict[str, str] = {p: name for name, g in GROUPS.items() for p in g["scope"]}
WIDENED = ("boundaries", "speculative")  # the groups of the widened run (--groups boundaries,speculative)


def use_groups(names: list[str]) -> None:
    """Restrict the run, its listing and its report to these groups (in this order)."""
    global GROUPS, SCOPE, GROUP_OF
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        sys.exit(f"unknown group(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    GROUPS = {n: GROUPS[n] for n in names}
    SCOPE = {p: pats for g in GROUPS.values() for p, pats in g["scope"].items()}
    GROUP_OF = {p: name for name, g in GROUPS.items() for p in g["scope"]}


def present_tests(tests: list[str]) -> list[str]:
    """The group's tests that exist in this checkout (a "before" run from an older commit lacks the new files)."""
    return [t for t in tests if (ROOT / t.partition("::")[0]).exists()]

SAMPLE_MOD = 8  # keep 1 mutant in SAMPLE_MOD (see "Sampling" above)

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


def prepare(base: Path, timeout_multiplier: float) -> None:
    if base.exists():
        shutil.rmtree(base)
    for group in GROUPS:
        prepare_group(base / group, group, timeout_multiplier)


def set_timeout_multiplier(workdir: Path, timeout_multiplier: float) -> None:
    """Rewrite the multiplier in a prepared group's pyproject.toml (mutmut then re-runs its timeouts)."""
    toml = workdir / "pyproject.toml"
    lines = [ln for ln in toml.read_text().splitlines() if not ln.startswith("timeout_multiplier =")]
    at = lines.index("[tool.mutmut]") + 1
    lines.insert(at, f"timeout_multiplier = {timeout_multiplier}")
    toml.write_text("\n".join(lines) + "\n")


def prepare_group(workdir: Path, group: str, timeout_multiplier: float = 15.0) -> None:
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
        f"pytest_add_cli_args_test_selection = {json.dumps(present_tests(GROUPS[group]['tests']))}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]',
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
        f"timeout_multiplier = {timeout_multiplier}",
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
    """"Class.method" / "function" -> (first line, decorators included; last line)."""
    tree = ast.parse(path.read_text())
    spans = {}

    def span(node):
        return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spans[node.name] = span(node)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    spans[f"{node.name}.{sub.name}"] = span(sub)
    return spans


def diff_of(base: Path, mutant: str, path: str) -> tuple[str, str, str, int]:
    """(changed lines of the diff, first removed line, first added line, its line in the function, from 1)."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    os.chdir(base / GROUP_OF[path])
    reset_config()
    diff = get_diff_for_mutant(mutant, path=path)
    lines = diff.splitlines()
    body = [ln for ln in lines if not ln.startswith(("---", "+++", "@@"))]
    removed = next((ln[1:] for ln in body if ln.startswith("-")), "")
    added = next((ln[1:] for ln in body if ln.startswith("+")), "")
    changed = [ln for ln in body if ln.startswith(("-", "+"))]
    offset, n = 1, None
    for ln in lines:
        if ln.startswith("@@"):
            n = int(ln.split()[1].lstrip("-").split(",")[0])
        elif n is not None and not ln.startswith(("---", "+++")):
            if ln.startswith("-"):
                offset = n
                break
            if not ln.startswith("+"):
                n += 1
    return "\n".join(changed), removed, added, offset


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
        lines.append(f"  - {name}: `pytest -x -q {' '.join(present_tests(g['tests']))}`")
        missing = [t for t in g["tests"] if t not in present_tests(g["tests"])]
        if missing:
            lines.append(f"    (not at this commit: {', '.join(f'`{t}`' for t in missing)})")
    if wall_s is not None:
        lines.append(f"- Wall time of the mutmut run: {wall_s / 60:.1f} min (2 shared CPU cores, other jobs running, "
                     f"nice {os.nice(0)})")
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

    notes = HERE / f"notes-{label}.md"  # hand-written reading of the survivors, grouped by behaviour
    if notes.exists():
        lines += ["", notes.read_text().rstrip()]

    def entries(mutants: list[str]) -> tuple[list[str], int]:
        out_lines, unjudged = [], 0
        for m in sorted(mutants, key=lambda m: (info[m]["path"], _lineno_key(m, info, spans), m)):
            i = info[m]
            diff, removed, added, offset = diff_of(base, m, i["path"])
            lo, hi = spans[i["path"]].get(i["qualname"], (1, len(src_lines[i["path"]])))
            # The diff's position, checked against the source; else the nearest line with that text.
            matches = [n for n in range(lo, hi + 1) if src_lines[i["path"]][n - 1].strip() == removed.strip()]
            line = min(matches, key=lambda n: abs(n - (lo + offset - 1)), default=lo + offset - 1)
            j = judgements.get(i["key"])
            if j and j.get("line", "").strip() != added.strip():
                j = None
            unjudged += j is None
            st = STATUS.get(codes.get(m), "suspicious")
            tag = "" if st == "survived" else f" **{st}**"
            out_lines += [f"- `{i['path'].removeprefix('src/')}:{line}` `{i['qualname']}` "
                          f"({i['key'].rpartition('__')[2]}){tag}: {j['judgement'] if j else '(to judge)'}",
                          "  ```diff", *("  " + d for d in diff.splitlines()), "  ```"]
        return out_lines, unjudged

    alive = ("survived", "timeout", "no tests", "suspicious")
    lines += ["", "## Surviving mutants", "",
              "Each: `file:line` function (mutant number), the mutation, and a judgement: *equivalent* (no "
              "observable behaviour changes) or *missing test* (the behaviour a test should pin).", ""]
    body, to_judge = entries([m for m in chosen if status[m] in alive])
    lines += body
    # Verdicts left in the work directory for mutants outside the sample (an earlier, larger sample).
    extra = [m for m, i in info.items() if not i["sampled"] and codes.get(m) is not None]
    if extra:
        extra_status = Counter(STATUS.get(codes[m], "suspicious") for m in extra)
        lines += ["", "## Also checked, outside the sample", "",
                  f"{len(extra)} more mutants have a verdict in the work directory (from a larger sample, cut "
                  f"for time): {', '.join(f'{v} {k}' for k, v in sorted(extra_status.items()))}. They are not "
                  "in the counts above; their survivors are listed here because they point at tests too.", ""]
        body, n = entries([m for m in extra if STATUS.get(codes[m], "suspicious") in alive])
        lines += body
        to_judge += n
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
    ap.add_argument("--timeout-multiplier", type=float, default=15.0,
                    help="mutmut's timeout_multiplier (its default 15): wall limit (expected test time + 1 s) x this")
    ap.add_argument("--retry-timeouts", action="store_true",
                    help="with --resume: also re-run mutants whose verdict is a timeout (use a larger --timeout-multiplier)")
    ap.add_argument("--groups", default=",".join(GROUPS), help="groups to run, in this order")
    args = ap.parse_args()
    use_groups(args.groups.split(","))
    workdir = (args.workdir or Path(f"/tmp/tgi-vlm-mutation-{args.label}")).resolve()
    out = (args.out or ROOT / f"benchmarks/results/mutation-{args.label}.md").resolve()

    if not (args.resume or args.report_only):
        prepare(workdir, args.timeout_multiplier)
    elif args.resume:
        for group in GROUPS:  # a group that never ran picks up the current GROUPS settings
            if not (workdir / group / "mutants").exists():
                shutil.rmtree(workdir / group, ignore_errors=True)
                prepare_group(workdir / group, group, args.timeout_multiplier)
            else:
                set_timeout_multiplier(workdir / group, args.timeout_multiplier)
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
            todo = [m for m in chosen if codes.get(m) is None
                    or (args.retry_timeouts and STATUS.get(codes[m]) == "timeout")]
        start = time.monotonic()
        for group in args.groups.split(","):
            names = [m for m in todo if info[m]["group"] == group]
            if names:
                print(f"{group}: {len(names)} mutants", flush=True)
                rc = run_mutmut(workdir / group, names, args.max_children)
                print(f"{group}: mutmut exited {rc} after {(time.monotonic() - start) / 60:.1f} min", flush=True)
        wall = time.monotonic() - start
        if args.resume and (workdir / "wall_s.txt").exists():  # an interrupted run's time counts too
            wall += float((workdir / "wall_s.txt").read_text())
        (workdir / "wall_s.txt").write_text(f"{wall:.0f}\n")
        print(f"done after {wall / 60:.1f} min; logs: {workdir}/*/mutmut.log")
    elif (workdir / "wall_s.txt").exists():
        wall = float((workdir / "wall_s.txt").read_text())
    report(workdir, args.label, out, info, args.sample_mod, wall)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
