"""Before/after comparison of two mutation runs of benchmarks/mutation/run.py (their scratch directories).

    python benchmarks/mutation/compare.py BEFORE_WORKDIR AFTER_WORKDIR [--json OUT]

Reads every mutant with a verdict in each work directory (mutants/**/*.meta), computes its mutation
(the changed lines, through mutmut's own diff code) and matches mutants across the two runs:

- by name: same "Class.method__mutmut_N" key and the same mutation (the function's body, up to that
  mutant, is unchanged, so the sampling rule drew the same mutant in both runs);
- by mutation: for functions the refactor renamed or moved (MOVED below), the same removed and added
  line in any of the new homes of the old function.

Prints, per module: the like-for-like counts over functions that kept their names, and the fate of
every "before" survivor in the "after" run (killed, survived, not drawn, or gone from the code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from difflib import unified_diff
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import STATUS, qualname, sampled, stable_key  # noqa: E402

# old "Class.method" -> the functions that now hold its behaviour (module functions of models/intake.py)
MOVED = {
    "FlashCausalLM.make_sequence": {"make_sequence", "check_request", "check_slots", "claim_slots",
                                    "request_chunks", "check_cached_prefix", "truncate_ids"},
    "FlashCausalLM._slots_for": {"claim_slots", "check_slots"},
    "FlashCausalLM.truncate": {"truncate_ids"},
}


def load(workdir: Path, every: bool = False) -> dict[str, dict]:
    """mutant name -> {path, qualname, key, status, removed, added, diff}: mutants with a verdict (a verdict
    in any of the work directory's group folders wins), or with every=True all mutants ("not checked")."""
    import libcst as cst
    from mutmut.mutation.diff_apply import read_mutant_function, read_original_function

    codes: dict[str, int | None] = {}
    source: dict[str, tuple[Path, str]] = {}
    for meta in sorted(workdir.glob("*/mutants/src/**/*.py.meta")):
        rel = str(Path(*meta.relative_to(workdir).parts[2:])).removesuffix(".meta")
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if code is not None or (every and name not in codes):
                codes[name] = code
            source.setdefault(name, (meta.with_suffix(""), rel))
    modules: dict[Path, object] = {}
    out: dict[str, dict] = {}
    for name, code in codes.items():
        if code is None and not every:
            continue
        src, rel = source[name]
        if src not in modules:
            modules[src] = cst.parse_module(src.read_text())
        module = modules[src]
        try:
            orig, mut = (cst.Module([f]).code.strip() for f in
                         (read_original_function(module, name), read_mutant_function(module, name)))
        except Exception:  # noqa: BLE001 - a mutant mutmut can no longer show
            orig = mut = ""
        lines = [ln for ln in unified_diff(orig.split("\n"), mut.split("\n"), lineterm="")
                 if ln.startswith(("-", "+")) and not ln.startswith(("---", "+++"))]
        removed = next((ln[1:].strip() for ln in lines if ln.startswith("-")), "")
        added = next((ln[1:].strip() for ln in lines if ln.startswith("+")), "")
        out[name] = {"path": rel, "qualname": qualname(name), "key": stable_key(name),
                     "status": STATUS.get(code, "suspicious") if code is not None else "not checked",
                     "removed": removed, "added": added, "diff": "\n".join(lines)}
    return out


ROW = {"src/tgi_vlm/models/flash_causal_lm.py": "src/tgi_vlm/models/intake.py"}  # before home -> after home


def _score(c: Counter) -> str:
    n = c["killed"] + c["survived"] + c["timeout"]
    return f"{(c['killed'] + c['timeout']) / n:.0%}" if n else "-"


def markdown(before_s: dict, after_s: dict, fate: list, after_sample: Path | None) -> str:
    unchecked: Counter = Counter()
    if after_sample:
        for name in after_sample.read_text().split():
            if name.startswith("tgi_vlm.") and name not in after_s:
                mod = name.partition("__mutmut_")[0].split(".x")[0]
                unchecked["src/" + mod.replace(".", "/") + ".py"] += 1
    per: dict[str, dict[str, Counter]] = defaultdict(lambda: {"before": Counter(), "after": Counter()})
    for label, runs in (("before", before_s), ("after", after_s)):
        for i in runs.values():
            per[ROW.get(i["path"], i["path"])][label][i["status"]] += 1
    for path, n in unchecked.items():
        per[path]["after"]["not checked"] += n
    out = ["| module | before: sampled | killed | survived | timeout | score | after: sampled | killed | survived | timeout | not checked | score |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    tot = {"before": Counter(), "after": Counter()}
    for path in sorted(per):
        b, a = per[path]["before"], per[path]["after"]
        tot["before"].update(b)
        tot["after"].update(a)
        name = path.removeprefix("src/tgi_vlm/") + (" (was models/flash_causal_lm.py)" if path in ROW.values() else "")
        out.append(f"| `{name}` | {sum(b.values()) or '-'} | {b['killed']} | {b['survived']} | {b['timeout']} | {_score(b)} | "
                   f"{sum(a.values()) or '-'} | {a['killed']} | {a['survived']} | {a['timeout']} | {a['not checked']} | {_score(a)} |")
    b, a = tot["before"], tot["after"]
    out.append(f"| **total** | **{sum(b.values())}** | **{b['killed']}** | **{b['survived']}** | **{b['timeout']}** | **{_score(b)}** | "
               f"**{sum(a.values())}** | **{a['killed']}** | **{a['survived']}** | **{a['timeout']}** | **{a['not checked']}** | **{_score(a)}** |")
    # the same mutants in both runs
    same = [f for f in fate if f["how"] == "same key"]
    per2: dict[str, Counter] = defaultdict(Counter)
    for f in same:
        per2[f["before"]["path"]][f"{f['before']['status']} -> {f['after']['status']}"] += 1
    kinds = sorted({k for c in per2.values() for k in c})
    out += ["", "| module (same mutant in both runs) | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for path in sorted(per2):
        out.append(f"| `{path.removeprefix('src/tgi_vlm/')}` | " + " | ".join(str(per2[path][k]) for k in kinds) + " |")
    t2 = sum(per2.values(), Counter())
    out.append("| **total** | " + " | ".join(f"**{t2[k]}**" for k in kinds) + " |")
    # every before survivor
    out += ["", "| before survivor | mutation | after |", "|---|---|---|"]
    for f in fate:
        if f["before"]["status"] == "killed":
            continue
        i, j = f["before"], f["after"]
        where = f"{j['status']} (`{j['key']}`, {f['how']})" if j else f["how"]
        out.append(f"| `{i['path'].removeprefix('src/tgi_vlm/')}` `{i['key']}` | `{i['added'][:70]}` | {where} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--sample-mod", type=int, default=8, help="keep the mutants of this sample (run.py's rule)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", action="store_true", help="print the before/after tables as markdown")
    ap.add_argument("--after-sample", type=Path,
                    help="file of the after run's sampled mutant names (run.py --dry-run), to count unchecked ones")
    args = ap.parse_args()
    cwd = os.getcwd()
    before, after = load(args.before), load(args.after, every=True)
    os.chdir(cwd)
    before_s = {m: i for m, i in before.items() if sampled(m, args.sample_mod)}
    # the after run's sample: its verdicts, plus (with --after-sample) the drawn mutants still unchecked
    drawn = set(args.after_sample.read_text().split()) if args.after_sample else set()
    after_s = {m: i for m, i in after.items() if sampled(m, args.sample_mod)
               and (i["status"] != "not checked" or m in drawn)}

    by_key_after = {i["key"]: i for i in after_s.values()}
    after_keys = set(by_key_after)
    by_mut_after = defaultdict(list)
    for i in after.values():  # every mutant of the after code, drawn or not
        by_mut_after[(i["removed"], i["added"])].append(i)

    def match(i: dict) -> tuple[str, dict | None]:
        j = by_key_after.get(i["key"])
        if j and (j["removed"], j["added"]) == (i["removed"], i["added"]):
            return "same key", j
        candidates = []
        homes = MOVED.get(i["qualname"], {i["qualname"]})
        for j in by_mut_after.get((i["removed"], i["added"]), []):
            if j["qualname"] in homes:
                candidates.append(j)
        drawn_j = [j for j in candidates if j["key"] in after_keys]
        how = "same mutation, moved" if i["qualname"] in MOVED else "same mutation, renumbered"
        if len(candidates) > 1:  # a generic line (`rid,` -> `None,`): the text alone does not say which
            how += f", ambiguous: {len(candidates)} after mutants make this change"
        if drawn_j:
            return how, drawn_j[0]
        if candidates:
            return how + f", not in the after sample (as {candidates[0]['key']})", None
        return "gone (the line changed)", None

    fate = []
    for _m, i in sorted(before_s.items(), key=lambda kv: (kv[1]["path"], kv[1]["key"])):
        how, j = match(i)
        fate.append({"before": i, "how": how, "after": j})

    # Like-for-like: functions present under the same name in both runs' samples.
    names_b = {(i["qualname"]) for i in before_s.values()}
    names_a = {(i["qualname"]) for i in after_s.values()}
    same = names_b & names_a
    per_mod: dict[str, dict[str, Counter]] = defaultdict(lambda: {"before": Counter(), "after": Counter()})
    for label, runs in (("before", before_s), ("after", after_s)):
        for i in runs.values():
            if i["qualname"] in same:
                per_mod[i["path"]][label][i["status"]] += 1
                per_mod[i["path"]][label]["sampled"] += 1
    result = {"per_module_same_names": {p: {k: dict(v) for k, v in c.items()} for p, c in per_mod.items()},
              "fate": [{"before": f["before"]["key"], "path": f["before"]["path"], "status_before": f["before"]["status"],
                        "mutation": f["before"]["diff"], "how": f["how"],
                        "after": f["after"]["key"] if f["after"] else None,
                        "after_path": f["after"]["path"] if f["after"] else None,
                        "status_after": f["after"]["status"] if f["after"] else None} for f in fate],
              "same_key_identical": sum(f["how"] == "same key" for f in fate)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        print(markdown(before_s, after_s, fate, args.after_sample))
        return
    for p, c in sorted(per_mod.items()):
        b, a = c["before"], c["after"]
        print(f"{p}: before {b['sampled']} sampled {b['killed']} killed {b['survived']} survived | "
              f"after {a['sampled']} sampled {a['killed']} killed {a['survived']} survived")
    print(Counter((f["how"], f["before"]["status"], f["after"]["status"] if f["after"] else None) for f in fate))


if __name__ == "__main__":
    main()
