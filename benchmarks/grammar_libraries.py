"""The grammar engines we could build on, measured the way the shard would use them.

For llguidance, xgrammar and outlines-core, on the bench model's vocabulary (~3.8k tokens) and on
a real 131k one (Mistral's tekken, shipped in the `mistral-common` wheel):
- vocabulary preprocessing (once per model, at start);
- compile time of the PERSON schema (ten fields, nested) as TGI's router sends it (the regex
  outlines-core 0.1.20 writes) and as a JSON Schema;
- per-step mask time at batch 16 and 64: every row walks its own valid document, rows at
  different positions; each step fills the batch's bitmask (the library's batched call where it
  has one) and consumes one token per row;
- regex dialect: router-compiled regexes of three schemas plus regexes in TGI's documentation
  style — does each compile, and does the matcher judge valid documents and near misses exactly
  as Python's `re.fullmatch` does?

Candidates live outside the project's environment (they are not dependencies):

    pip install --target /tmp/gramlibs --no-deps llguidance xgrammar outlines-core apache-tvm-ffi
    pip download --no-deps -d /tmp/mc mistral-common && unzip -o /tmp/mc/mistral_common-*.whl \\
        'mistral_common/data/tekken_240911.json' -d /tmp/mc
    .venv/bin/python benchmarks/grammar_libraries.py --libs-path /tmp/gramlibs \\
        --tekken /tmp/mc/mistral_common/data/tekken_240911.json

Writes benchmarks/results/grammar_libraries.{json,md}.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_step import machine  # noqa: E402

from tgi_vlm.testing import tiny_model_path  # noqa: E402
from tgi_vlm.testing.schemas import PERSON, PROFILE, person_instance, router_regex  # noqa: E402

RESULTS = Path(__file__).parent / "results"
OFFSET_STRIDE = 7  # row i starts its walk i*7 tokens in, so a batch holds many grammar states


@dataclass
class Vocab:
    name: str
    tokens: list[bytes]  # by id; special tokens as b"" (never allowed by a grammar)
    eos: int
    special: set[int]


def bench_vocab() -> Vocab:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("llama", size="bench"))
    decoder = {c: b for b, c in _bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    tokens = [b"" if i in special else bytes(decoder[c] for c in t)
              for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))]
    return Vocab("bench (byte-level BPE)", tokens, tokenizer.eos_token_id, special)


def tekken_vocab(path: str) -> Vocab:
    data = json.loads(Path(path).read_text())
    num_special, size = data["config"]["default_num_special_tokens"], data["config"]["default_vocab_size"]
    tokens = [b""] * num_special + [base64.b64decode(e["token_bytes"]) for e in data["vocab"][: size - num_special]]
    return Vocab("tekken (Mistral, 131k)", tokens, 2, set(range(num_special)))  # id 2 is </s>


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


# ----- one adapter per library --------------------------------------------------------------------


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int):
        import llguidance

        self.llg = llguidance
        wrapper = _TokenList(vocab)
        from tgi_vlm.generation.grammar_compiler import SLICES

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), slices=SLICES)
        self.executor = llguidance.LLExecutor(threads)
        self.version = importlib.metadata.version("llguidance")

    def compile(self, kind: str, text: str):
        grammar = (self.llg.LLMatcher.grammar_from_regex(text) if kind == "regex"
                   else self.llg.LLMatcher.grammar_from_json_schema(text, overrides={"whitespace_pattern": r"[ ]?"}))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        matcher.compute_bitmask()  # what the shard does at compile (the first mask)
        return matcher

    def matchers(self, compiled, n: int) -> list:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(vocab.tokens, xgrammar.VocabType.RAW, stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(threads)
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, kind: str, text: str):
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_json_schema(text, any_whitespace=False)

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.accept_token(matcher.stop_token_ids[0])  # EOS is accepted exactly where the grammar is


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: Vocab, threads: int):
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, t in enumerate(vocab.tokens):
            if i not in vocab.special and t:
                by_bytes.setdefault(t, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos, by_bytes)
        self.eos = vocab.eos
        self.version = importlib.metadata.version("outlines-core")

    def compile(self, kind: str, text: str):
        regex = text if kind == "regex" else self.oc.json_schema.build_regex_from_schema(text)
        return self.oc.Index(regex, self.vocabulary)

    def matchers(self, compiled, n: int) -> list:
        return [self.oc.Guide(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:  # no batched call: one row at a time
        for i, guide in enumerate(matchers):
            row = bitmask[i]
            guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def consume(self, matcher, token: int) -> bool:
        try:
            matcher.advance(token)
            return True
        except ValueError:
            return False

    def accepting(self, matcher) -> bool:
        return self.eos in matcher.get_tokens()  # outlines allows EOS exactly in final states


class _TokenList:
    """The minimal tokenizer llguidance's TokenizerWrapper reads (special tokens marked with 0xFF)."""

    def __init__(self, vocab: Vocab):
        self.eos_token_id = vocab.eos
        self.bos_token_id = None
        self.tokens = [b"\xff<special_%d>" % i if i in vocab.special else t for i, t in enumerate(vocab.tokens)]
        self.special_token_ids = sorted(vocab.special)

    def __call__(self, text: bytes) -> list[int]:
        return []  # only used for features the benchmark does not touch


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


# ----- measurements -------------------------------------------------------------------------------


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def walks(vocab: Vocab, n: int) -> list[list[int]]:
    """Token ids of n valid PERSON documents (greedy longest match over the vocabulary)."""
    tokenize = _greedy({t: i for i, t in enumerate(vocab.tokens) if t and i not in vocab.special})
    return [tokenize(person_instance(i)) for i in range(n)]


def mask_steps(lib, compiled, tokens: list[list[int]], batch: int, steps: int, vocab_size: int) -> dict:
    matchers = lib.matchers(compiled, batch)
    starts = [(OFFSET_STRIDE * i) % 50 for i in range(batch)]
    for m, walk, s in zip(matchers, tokens, starts):
        for t in walk[:s]:
            assert lib.consume(m, t)
    bitmask = torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)
    fills, consumes = [], []
    for step in range(steps):
        _, fill_ms = timed(lambda: lib.fill(matchers, bitmask))
        _, consume_ms = timed(lambda step=step: [lib.consume(m, w[s + step]) for m, w, s in zip(matchers, tokens, starts)])
        fills.append(fill_ms)
        consumes.append(consume_ms)
    return dict(fill_mean_ms=statistics.mean(fills), fill_median_ms=statistics.median(fills),
                fill_max_ms=max(fills), consume_mean_ms=statistics.mean(consumes))


def dialect_cases() -> list[tuple[str, list[str]]]:
    """(regex, texts to judge) for router-compiled schemas and documentation-style regexes."""
    person = router_regex(PERSON)
    profile = router_regex(PROFILE)
    good_profile = '{"name": "ann", "age": 31, "role": "user", "active": true, "address": {"zip": "12345"}}'
    cases = [
        (person, [person_instance(i) for i in range(3)] + _misses(person_instance(0))),
        (profile, [good_profile, good_profile.replace(": ", ":")] + _misses(good_profile)),
        (r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
         ["192.168.0.1", "255.255.255.255", "256.1.1.1", "1.2.3"]),
        (r"\d{3}-\d{4}", ["555-1234", "55-1234", "555-12345"]),
        (r"(?:yes|no|maybe)", ["yes", "maybe", "yess"]),
        (r"[A-Z][a-z]+ [A-Z][a-z]+", ["Ada Lovelace", "ada Lovelace"]),
        (r"\w+@\w+\.com", ["ada@example.com", "ada@example.org"]),
        (r"(?i)hello", ["HeLLo", "help"]),
        (r"\w+ [^\n]{1,5}", ["café ok!", "café\nx"]),
    ]
    return cases


def _misses(text: str) -> list[str]:
    mid = len(text) // 2
    return [text[:-1], text + " ", text[:mid] + text[mid + 1 :], text[:mid] + "\n" + text[mid:]]


def dialect(lib, tokenize, cases: list[tuple[str, list[str]]]) -> dict:
    compiled, agreed = 0, 0
    for regex, texts in cases:
        try:
            grammar = lib.compile("regex", regex)
        except Exception:  # noqa: BLE001 - any refusal counts as "does not compile"
            continue
        compiled += 1
        verdicts = []
        for text in texts:
            m = lib.matchers(grammar, 1)[0]
            ok = all(lib.consume(m, t) for t in tokenize(text)) and lib.accepting(m)
            verdicts.append(ok == (re.fullmatch(regex, text) is not None))
        agreed += all(verdicts)
    return dict(cases=len(cases), compiled=compiled, agreed=agreed)


def bench_library(name: str, vocab: Vocab, threads: int, batches: list[int], steps: int, tokens,
                  person_regex: str) -> dict:
    cls = LIBRARIES[name]
    lib, vocab_ms = timed(lambda: cls(vocab, threads))
    row = dict(library=name, version=lib.version, vocabulary_ms=vocab_ms)
    for kind, text in (("regex", person_regex), ("json", json.dumps(PERSON))):
        compiled, compile_ms = timed(lambda kind=kind, text=text: lib.compile(kind, text))
        row[f"compile_{kind}_ms"] = compile_ms
        for b in batches:
            row[f"{kind}_b{b}"] = mask_steps(lib, compiled, tokens, b, steps, len(vocab.tokens))
    return row


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# grammar_libraries — {result['timestamp']}", "",
             f"CPU: {m['cpu']}, {m['cores']} cores, library threads {result['threads']}; PERSON schema "
             f"(router regex {result['person_regex_bytes']} bytes); mask time per step = filling the batch's "
             f"bitmask (mean over {result['steps']} steps, rows at different positions)", ""]
    for vocab in result["vocabularies"]:
        lines += [f"## {vocab['name']}, {vocab['size']} tokens", "",
                  "| library | vocab prep ms | compile regex ms | compile JSON ms | regex mask ms b16 / b64 "
                  "| JSON mask ms b16 / b64 | worst step ms (regex b64) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in vocab["libraries"]:
            lines.append(
                f"| {r['library']} {r['version']} | {r['vocabulary_ms']:.0f} | {r['compile_regex_ms']:.1f} "
                f"| {r['compile_json_ms']:.1f} | {r['regex_b16']['fill_mean_ms']:.2f} / {r['regex_b64']['fill_mean_ms']:.2f} "
                f"| {r['json_b16']['fill_mean_ms']:.2f} / {r['json_b64']['fill_mean_ms']:.2f} "
                f"| {r['regex_b64']['fill_max_ms']:.1f} |")
        lines.append("")
    lines += ["## Regex dialect (router-compiled schemas + documentation-style regexes)", "",
              "| library | compiled | judged every text like `re.fullmatch` |", "|---|---:|---:|"]
    for name, d in result["dialect"].items():
        lines.append(f"| {name} | {d['compiled']}/{d['cases']} | {d['agreed']}/{d['cases']} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--libs-path", help="directory holding the candidate libraries (pip --target)")
    parser.add_argument("--tekken", help="path to tekken_240911.json (mistral-common)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Router-shaped regexes come from the project's outlines-core 0.1.20 (TGI's router's), before
    # the candidates' newer outlines-core replaces it in this process.
    person_regex, cases = router_regex(PERSON), dialect_cases()
    if args.libs_path:
        sys.path.insert(0, args.libs_path)
        for mod in [m for m in sys.modules if m.startswith("outlines_core")]:
            del sys.modules[mod]
    names = args.libraries.split(",")
    vocabs = [bench_vocab()] + ([tekken_vocab(args.tekken)] if args.tekken else [])
    result = dict(timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=machine(),
                  threads=args.threads, steps=args.steps, person_regex_bytes=len(person_regex), vocabularies=[],
                  dialect={})
    for vocab in vocabs:
        tokens = walks(vocab, 64)
        rows = [bench_library(n, vocab, args.threads, [16, 64], args.steps, tokens, person_regex) for n in names]
        result["vocabularies"].append(dict(name=vocab.name, size=len(vocab.tokens), libraries=rows))
        print(markdown(result), flush=True)
    tokenize = _greedy({t: i for i, t in enumerate(vocabs[0].tokens) if t})
    for n in names:
        result["dialect"][n] = dialect(LIBRARIES[n](vocabs[0], args.threads), tokenize, cases)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grammar_libraries.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "grammar_libraries.md").write_text(markdown(result))
    print(markdown(result))


def _greedy(index: dict[bytes, int]):
    longest = max(len(t) for t in index)

    def tokenize(text: str) -> list[int]:
        data, ids, pos = text.encode(), [], 0
        while pos < len(data):
            size = next(s for s in range(min(longest, len(data) - pos), 0, -1) if data[pos : pos + s] in index)
            ids.append(index[data[pos : pos + size]])
            pos += size
        return ids

    return tokenize


if __name__ == "__main__":
    main()
