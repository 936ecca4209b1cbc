"""Planted bugs: each boundary test is shown to fail on the one-line bug it was written to catch.

    python benchmarks/mutation/planted.py [--only NAME,...] [--out benchmarks/results/planted-bugs.md]

For every entry of PLANTS (a name, a source file, an exact line fragment and its replacement, the tests that
must catch it), in a scratch copy of src/ and tests/ (the checkout is never rewritten): check that the tests
pass on the unchanged code, plant the bug (the fragment must occur exactly once in the file), run the tests
(`pytest -x -q`), and record the first failing test and its error line. An entry whose tests still pass is
reported as SURVIVED and the script exits 1. Writes a markdown table (name, file, change, failing test, how).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

API = "tests/unit/test_api_validation_limits.py"
KEYS = "tests/unit/test_prefix_key_chain.py"
ENC = "tests/unit/test_encoder_cache_bytes.py"
NATIVE = "tests/unit/test_native_entry_bounds.py"
SPEC = "tests/models/test_speculative_stops.py"
STATES = "tests/unit/test_prefix_cache_bookkeeping.py"
OPS = "src/tgi_vlm/kernels/cpu/ops.py"
DRAFTER = "tests/unit/test_speculative_drafter.py"


@dataclass(frozen=True)
class Plant:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that must fail


V = "src/tgi_vlm/api/validation.py"
PLANTS = [
    # ----- HTTP validation limits -----
    Plant("default max_new_tokens off by one (every request without it refused)", V,
          "max_new_tokens = max(total - input_length, 0) if asked is None else asked",
          "max_new_tokens = max(total - input_length, 0) + 1 if asked is None else asked", (API,)),
    Plant("default max_new_tokens one short", V,
          "max_new_tokens = max(total - input_length, 0) if asked is None else asked",
          "max_new_tokens = max(total - input_length - 1, 0) if asked is None else asked", (API,)),
    Plant("input + max_new_tokens == max_total_tokens refused", V,
          "if input_length + max_new_tokens > total:", "if input_length + max_new_tokens >= total:", (API,)),
    Plant("input == max_input_tokens refused", V, "if input_length > limit:", "if input_length >= limit:", (API,)),
    Plant("truncate == max_input_tokens refused", V, "truncate == 0 or truncate > limit",
          "truncate == 0 or truncate >= limit", (API,)),
    Plant("truncate 0 accepted", V, "truncate == 0 or truncate > limit", "truncate > limit", (API,)),
    Plant("truncate dropped on the way to the shard", V, "return truncate or 0", "return 0", (API,)),
    Plant("top_n_tokens == max_top_n_tokens refused", V, "p.top_n_tokens > self.config.max_top_n_tokens",
          "p.top_n_tokens >= self.config.max_top_n_tokens", (API,)),
    Plant("top_n_tokens not sent", V, "top_n_tokens=p.top_n_tokens or 0,", "top_n_tokens=0,", (API,)),
    Plant("max_stop_sequences stop sequences refused", V, "if len(p.stop) > self.config.max_stop_sequences:",
          "if len(p.stop) >= self.config.max_stop_sequences:", (API,)),
    Plant("frequency_penalty -2.0 refused", V, "not -2.0 <= p.frequency_penalty <= 2.0",
          "not -2.0 < p.frequency_penalty <= 2.0", (API,)),
    Plant("typical_p not sent", V, "typical_p=_or(p.typical_p, 1.0)", "typical_p=1.0", (API,)),
    Plant("decoder_input_details without details", V, "p.details or p.decoder_input_details,",
          "p.details,", (API,)),
    Plant("the router driver refuses input + max_new_tokens == max_total_tokens", "src/tgi_vlm/router/router.py",
          "if n + new > shard.max_total_tokens:", "if n + new >= shard.max_total_tokens:", (API,)),
    # ----- the prefix-cache key chain -----
    Plant("block keys not chained (each block keyed on itself)", "src/tgi_vlm/prefix_hash.py",
          "chain_key(keys[-1] if keys else root, ids", "chain_key(root, ids", (KEYS,)),
    Plant("chain_key ignores its parent", "src/tgi_vlm/prefix_hash.py", "h = hashlib.sha256(parent)",
          "h = hashlib.sha256(KEY_VERSION)", (KEYS,)),
    Plant("the shard's records not chained", "src/tgi_vlm/models/prefix_cache.py",
          "parent = seq.block_keys[j - 1] if j else namespace_root(seq.adapter_id)",
          "parent = namespace_root(seq.adapter_id)", (KEYS,)),
    Plant("an image ending where a block starts keys that block", "src/tgi_vlm/prefix_hash.py",
          "ref.offset < end and ref.end > start", "ref.offset < end and ref.end >= start", (KEYS,)),
    Plant("an image starting where a block ends keys that block", "src/tgi_vlm/prefix_hash.py",
          "ref.offset < end and ref.end > start", "ref.offset <= end and ref.end > start", (KEYS,)),
    Plant("the image offset left out of the key", "src/tgi_vlm/prefix_hash.py",
          'return f"m{ref.kind.value}:{ref.offset}:{ref.length}:{ref.digest}".encode()',
          'return f"m{ref.kind.value}:{ref.length}:{ref.digest}".encode()',
          (KEYS,)),
    Plant("a partial last block keyed", "src/tgi_vlm/prefix_hash.py",
          "range(0, n - n % block_size, block_size)", "range(0, n, block_size)", (KEYS,)),
    Plant("the key limit ignored", "src/tgi_vlm/prefix_hash.py",
          "n = len(ids) if limit is None else min(limit, len(ids))", "n = len(ids)", (KEYS,)),
    # ----- the cross-request encoder cache -----
    Plant("an entry the size of the budget not kept", "src/tgi_vlm/models/encoder_cache.py",
          "if size > self.shared_capacity or", "if size >= self.shared_capacity or", (ENC,)),
    Plant("eviction while at the budget, not over it", "src/tgi_vlm/models/encoder_cache.py",
          "while self._shared_bytes > self.shared_capacity:", "while self._shared_bytes >= self.shared_capacity:",
          (ENC,)),
    Plant("eviction subtracts elements, not bytes", "src/tgi_vlm/models/encoder_cache.py",
          "self._shared_bytes -= evicted.numel() * evicted.element_size()", "self._shared_bytes -= evicted.numel()",
          (ENC,)),
    Plant("size counted in float32 bytes whatever the dtype", "src/tgi_vlm/models/encoder_cache.py",
          "size = features.numel() * features.element_size()", "size = features.numel() * 4", (ENC,)),
    Plant("a kept entry's bytes replace the total", "src/tgi_vlm/models/encoder_cache.py",
          "self._shared_bytes += size", "self._shared_bytes = size", (ENC,)),
    Plant("an entry that is no view copied anyway", "src/tgi_vlm/models/encoder_cache.py",
          "if features.untyped_storage().nbytes() > size:", "if features.untyped_storage().nbytes() >= size:", (ENC,)),
    Plant("clear_shared keeps the byte count", "src/tgi_vlm/models/encoder_cache.py",
          "self._shared.clear()\n        self._shared_bytes = 0", "self._shared.clear()", (ENC,)),
    Plant("misses counted once (the before run's survivor EncoderCache.lookup__mutmut_4)",
          "src/tgi_vlm/models/encoder_cache.py", "self.misses += 1", "self.misses = 1", (ENC,)),
    Plant("a hit does not refresh the entry", "src/tgi_vlm/models/encoder_cache.py",
          "self._shared.move_to_end(content_key)", "None", (ENC,)),
    # ----- the bounds checks at the native ops' entry points (kernels/cpu/ops.py) -----
    Plant("decode_attention lets slot == num_slots through", OPS,
          "if largest >= k_cache.shape[0]:\n        return", "if largest > k_cache.shape[0]:\n        return", (NATIVE,)),
    Plant("decode_attention lets row == num_rows through", OPS, "rows_low < 0 or rows_high >= q.shape[0]",
          "rows_low < 0 or rows_high > q.shape[0]", (NATIVE,)),
    Plant("decode_attention lets row -1 through", OPS, "rows_low < 0 or rows_high >= q.shape[0]",
          "rows_low < -1 or rows_high >= q.shape[0]", (NATIVE,)),
    Plant("decode_attention refuses end == width", OPS, "starts_low < 0 or ends_high > slot_index.shape[1]",
          "starts_low < 0 or ends_high >= slot_index.shape[1]", (NATIVE,)),
    Plant("decode_attention lets end == width + 1 through", OPS, "starts_low < 0 or ends_high > slot_index.shape[1]",
          "starts_low < 0 or ends_high > slot_index.shape[1] + 1", (NATIVE,)),
    Plant("decode_attention lets start -1 through", OPS, "starts_low < 0 or ends_high > slot_index.shape[1]",
          "starts_low < -1 or ends_high > slot_index.shape[1]", (NATIVE,)),
    Plant("decode_attention without sequences checks indices of nothing", OPS,
          "if not row_spans.shape[1]:\n        return", "if False:\n        return", (NATIVE,)),
    Plant("decode_attention hands the index's rows, not its width", OPS,
          "slot_index.data_ptr(), slot_index.shape[1], rows.data_ptr()",
          "slot_index.data_ptr(), slot_index.shape[0], rows.data_ptr()", (NATIVE,)),
    Plant("rotary_and_store lets slot == num_slots through", OPS,
          "if largest >= k_cache.shape[0]:\n        raise", "if largest > k_cache.shape[0]:\n        raise", (NATIVE,)),
    Plant("rotary_and_store takes int32 slots", OPS,
          "if slots.dtype != torch.long or slots.shape != (tokens,)", "if slots.shape != (tokens,)", (NATIVE,)),
    Plant("a negative slot bounded by the largest one", OPS, "return high if low >= 0 else sys.maxsize",
          "return high", (NATIVE,)),
    Plant("the largest of few slots taken as the last", OPS, "low, high = min(values), max(values)",
          "low, high = min(values), values[-1]", (NATIVE,)),
    Plant("skinny_linear lets one row past its limit through", OPS, "if rows > lib.skinny_max_rows:",
          "if rows > lib.skinny_max_rows + 1:", (NATIVE,)),
    Plant("skinny_linear takes zero rows", OPS, "x.shape[0] >= 1 and out_features >= 1",
          "x.shape[0] >= 0 and out_features >= 1", (NATIVE,)),
    Plant("a kv_len equal to the slot index width refused", "src/tgi_vlm/layers/attention/cpu_backend.py",
          "max(self.group.kv_len_list, default=0) > self.slot_index.shape[1]",
          "max(self.group.kv_len_list, default=0) >= self.slot_index.shape[1]", (NATIVE,)),
    Plant("the sliding window one position short", "src/tgi_vlm/layers/attention/cpu_backend.py",
          "start = max(start, length - sliding_window)", "start = max(start, length - sliding_window + 1)", (NATIVE,)),
    Plant("the attention chunk's start one chunk early", "src/tgi_vlm/layers/attention/cpu_backend.py",
          "start = max(start, (length - 1) // chunk * chunk)", "start = max(start, (length - 1) // chunk * chunk - chunk)",
          (NATIVE,)),
    # ----- speculative decoding: a stop inside an accepted run -----
    Plant("drafts accepted past a finished request", "src/tgi_vlm/models/flash_causal_lm.py",
          "if reasons[i] is None and accepts(seq.draft, level, token):", "if accepts(seq.draft, level, token):",
          (SPEC,)),
    Plant("a verified run advances by its whole draft", "src/tgi_vlm/models/flash_causal_lm.py",
          "w.seq.advance(len(tokens))  #", "w.seq.advance(len(w.seq.draft) + 1)  #", (SPEC,)),
    Plant("accepted drafts counted with the bonus token", "src/tgi_vlm/models/flash_causal_lm.py",
          "self.speculation.record(len(w.seq.draft), len(tokens) - 1)",
          "self.speculation.record(len(w.seq.draft), len(tokens))", (SPEC,)),
    Plant("a rejected run recorded as accepted (no back-off)", "src/tgi_vlm/models/flash_causal_lm.py",
          "w.seq.record_verified_run(len(tokens) - 1)", "w.seq.record_verified_run(len(tokens))", (SPEC,)),
    Plant("drafts not limited by max_new_tokens", "src/tgi_vlm/models/flash_causal_lm.py",
          "min(self.config.speculate, seq.max_draft)", "self.config.speculate", (SPEC,)),
    # ----- survivors of the widened mutation runs, planted by hand (the same one-line change) -----
    Plant("a counting error keeps its request prefix (Validator.input_ids__mutmut_12)", V,
          'raise validation_error(_REQUEST_PREFIX.sub("", str(exc))) from None\n\n    def _max',
          'raise validation_error(_REQUEST_PREFIX.sub("XXXX", str(exc))) from None\n\n    def _max', (API,)),
    Plant("the validator's ids and images not handed to the router (validate__mutmut_91)", V,
          "prompt = await self._prompt_tokens(params) if self.prompt_tokens else None", "prompt = None", (API,)),
    Plant("the prompt counted again after tokenizing (validate__mutmut_96)", V,
          "input_length = len(prompt) if prompt is not None else await self._count(params)",
          "input_length = len(prompt) if (prompt is not None) and False else await self._count(params)", (API,)),
    Plant("return_full_text ignored (validate__mutmut_120)", V, "bool(p.return_full_text), prompt)",
          "bool(None), prompt)", (API,)),
    Plant("a group's start read one position early (outside_groups__mutmut_8)", "src/tgi_vlm/router/prefix_cache.py",
          "group = group_ids[cache_len - 1]", "group = group_ids[cache_len - 2]", (STATES,)),
    Plant("the walk back to a group's start in steps of 2 (outside_groups__mutmut_25)",
          "src/tgi_vlm/router/prefix_cache.py", "start -= 1", "start -= 2", (STATES,)),
    Plant("an idle distrusted block not returned to the pool (_unindex__mutmut_7)",
          "src/tgi_vlm/router/prefix_cache.py", "if block in self._lru:  # idle and no longer cached: free\n"
          "            del self._lru[block]\n            self.pool.free([block])",
          "if block in self._lru:  # idle and no longer cached: free\n            del self._lru[block]\n"
          "            self.pool.free(None)", (STATES,)),
    Plant("refs of an unheld block None (refs__mutmut_4)", "src/tgi_vlm/router/prefix_cache.py",
          "return self._refs.get(block, 0)", "return self._refs.get(block, )", (STATES,)),
    Plant("token texts dropped from a verified run (sample__mutmut_59)", "src/tgi_vlm/models/flash_causal_lm.py",
          "EmittedToken(token, chosen.logprobs[j], text, top)", "EmittedToken(token, chosen.logprobs[j], None, top)",
          (SPEC,)),
    Plant("top-n never computed (sample__mutmut_48)", "src/tgi_vlm/models/flash_causal_lm.py",
          "if seq.top_n_tokens and chosen.logprob_rows is not None:",
          "if seq.top_n_tokens and chosen.logprob_rows is None:", (SPEC,)),
    Plant("prompt logprobs dropped (sample__mutmut_94)", "src/tgi_vlm/models/flash_causal_lm.py",
          "self.outputs.generation(w.seq, tokens, reason, values)", "self.outputs.generation(w.seq, tokens, reason, None)",
          (SPEC,)),
    Plant("drafted counted as the last run's only (record__mutmut_4)", "src/tgi_vlm/models/flash_causal_lm.py",
          "self.drafted += drafted", "self.drafted = drafted", (SPEC,)),
    Plant("the log line's acceptance None (record__mutmut_13)", "src/tgi_vlm/models/flash_causal_lm.py",
          "self.acceptance_rate, 1 + self.accepted / self.runs)", "None, 1 + self.accepted / self.runs)", (DRAFTER,)),
    Plant("the most recent one-token match beats a longer one (propose__mutmut_32)", "src/tgi_vlm/generation/speculative.py",
          "while n < self.max_ngram and at - n >= 0", "while n < self.max_ngram or at - n >= 0", (DRAFTER,)),
    Plant("the suffix compared forwards (propose__mutmut_37)", "src/tgi_vlm/generation/speculative.py",
          "ids[at - n] == ids[end - n]", "ids[at + n] == ids[end - n]", (DRAFTER,)),
    Plant("an empty history drafted from (propose__mutmut_1)", "src/tgi_vlm/generation/speculative.py",
          "if max_tokens <= 0 or len(ids) < 2:", "if max_tokens <= 0 and len(ids) < 2:", (DRAFTER,)),
    # ----- written for the widened after run's survivors (benchmarks/results/mutation-widened-after.md) -----
    Plant("an unseeded sampling request gets no random seed (Validator.validate__mutmut_83)", V,
          "seed=secrets.randbits(64) if p.seed is None else p.seed",
          "seed=secrets.randbits(64) if (p.seed is None) and False else p.seed", (API,)),
    Plant("the not-loaded reason dropped (_loaded__mutmut_7)", OPS,
          'reason = kernels.reason(op) if kernels is not None else "the native kernels were not loaded (kernels.cpu.load)"',
          "reason = None", (NATIVE,)),
    Plant("a head size off the multiple of 16 accepted (_cache_problem__mutmut_3)", OPS,
          "and 0 < shape[2] <= MAX_HEAD_DIM and shape[2] % 16 == 0):",
          "and 0 < shape[2] <= MAX_HEAD_DIM or shape[2] % 16 == 0):", (NATIVE,)),
    Plant("decode_attention's query not checked for the CPU (_decode_problem__mutmut_8)", OPS,
          "if not _all_cpu(q, out, k_cache, v_cache, slot_index, row_spans):",
          "if not _all_cpu(None, out, k_cache, v_cache, slot_index, row_spans):", (NATIVE,)),
    Plant("decode_attention's key cache not checked for the CPU (_decode_problem__mutmut_10)", OPS,
          "if not _all_cpu(q, out, k_cache, v_cache, slot_index, row_spans):",
          "if not _all_cpu(q, out, None, v_cache, slot_index, row_spans):", (NATIVE,)),
    Plant("the query-shape message fails to format (_decode_problem__mutmut_46)", OPS,
          'f"{tuple(k_cache.shape)} {k_cache.dtype}")', 'f"{tuple(None)} {k_cache.dtype}")', (NATIVE,)),
    Plant("a strided slot index accepted (_decode_problem__mutmut_60)", OPS,
          "slot_index.dim() == 2 and slot_index.is_contiguous()):",
          "slot_index.dim() == 2 or slot_index.is_contiguous()):", (NATIVE,)),
    Plant("an empty slot index counted as slot 1 (_decode_index_problem__mutmut_6)", OPS,
          "largest = slot_bound(slot_index, empty=0)", "largest = slot_bound(slot_index, empty=1)", (NATIVE,)),
    Plant("a product of another rank accepted by rotary_and_store (_rotary_problem__mutmut_5)", OPS,
          "qkv.is_cpu and len(shape) == 3", "qkv.is_cpu or len(shape) == 3", (NATIVE,)),
    Plant("the sine table not checked when the cosine is on the CPU (_rotary_problem__mutmut_55)", OPS,
          "if not (cos.is_cpu and sin.is_cpu and", "if not (cos.is_cpu or sin.is_cpu and", (NATIVE,)),
    Plant("the rotary-table message fails to format (_rotary_problem__mutmut_75)", OPS,
          "/ {tuple(sin.shape)} are not [1, T, D]", "/ {tuple(None)} are not [1, T, D]", (NATIVE,)),
    Plant("skinny_linear's weight not checked for the CPU (_linear_problem__mutmut_17)", OPS,
          "if not (_all_cpu(x, blocked, bias) and", "if not (_all_cpu(x, bias) and", (NATIVE,)),
    Plant("skinny_linear's bias not checked for the CPU (_linear_problem__mutmut_18)", OPS,
          "if not (_all_cpu(x, blocked, bias) and", "if not (_all_cpu(x, blocked, ) and", (NATIVE,)),
    Plant("skinny_linear refuses one output column (_linear_problem__mutmut_26)", OPS,
          "x.shape[0] >= 1 and out_features >= 1", "x.shape[0] >= 1 and out_features > 1", (NATIVE,)),
    Plant("top-n never reported (FlashCausalLM.sample__mutmut_48, a timeout)", "src/tgi_vlm/models/flash_causal_lm.py",
          "if seq.top_n_tokens and chosen.logprob_rows is not None:",
          "if seq.top_n_tokens and chosen.logprob_rows is None:",
          ("tests/models/test_text_generation_features.py::test_top_n_tokens_are_the_true_top_n_of_the_first_token",)),
]


def run_tests(workdir: Path, tests: tuple[str, ...]) -> tuple[bool, str]:
    env = dict(os.environ, PYTHONPATH="src:.", PYTHONHASHSEED="0")
    result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                             *tests], cwd=workdir, env=env, capture_output=True, text=True)
    return result.returncode == 0, result.stdout + result.stderr


def first_failure(output: str) -> tuple[str, str]:
    """(failing test id, its error line) from pytest -q output."""
    test = next((m.group(1) for m in re.finditer(r"^FAILED (\S+)", output, re.M)), "?")
    error = next((ln.strip()[2:].strip() for ln in output.splitlines() if ln.startswith("E ")), "")
    return test, error[:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated names (substrings) to run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/planted-bugs.md")
    args = ap.parse_args()
    plants = [p for p in PLANTS if not args.only or any(s in p.name for s in args.only.split(","))]
    rows, survived = [], []
    with tempfile.TemporaryDirectory(prefix="tgi-vlm-planted-") as tmp:
        work = Path(tmp)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, work / part, ignore=ignore)
        shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
        for plant in plants:  # every fragment first: a plant that no longer matches its file fails at once
            if (count := (work / plant.path).read_text().count(plant.old)) != 1:
                sys.exit(f"{plant.name}: {plant.old!r} occurs {count} times in {plant.path}")
        for tests in sorted({p.tests for p in plants}):
            ok, output = run_tests(work, tests)
            if not ok:
                sys.exit(f"the tests fail on the unchanged code: {' '.join(tests)}\n{output[-3000:]}")
        for plant in plants:
            target = work / plant.path
            original = target.read_text()
            if original.count(plant.old) != 1:
                sys.exit(f"{plant.name}: {plant.old!r} occurs {original.count(plant.old)} times in {plant.path}")
            target.write_text(original.replace(plant.old, plant.new))
            try:
                ok, output = run_tests(work, plant.tests)
            finally:
                target.write_text(original)
            test, error = first_failure(output) if not ok else ("-", "")
            print(f"{'SURVIVED' if ok else 'caught  '}  {plant.name}: {test}", flush=True)
            if ok:
                survived.append(plant.name)
            rows.append(f"| {plant.name} | `{plant.path.removeprefix('src/tgi_vlm/')}` | `{' '.join(plant.old.split())}` -> "
                        f"`{plant.new}` | {'**survived**' if ok else f'`{test}`'} | {error.replace('|', '/')} |")
    lines = ["# Planted bugs", "", "Generated by `benchmarks/mutation/planted.py`: each one-line bug planted alone in a "
             "scratch copy, the listed tests run with `pytest -x`; the first failing test and its error line.", "",
             "| bug | file | change | failing test | how it failed |", "|---|---|---|---|---|", *rows]
    if not args.only:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
