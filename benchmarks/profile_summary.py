"""Where a serving step's time goes, from a py-spy collapsed-stack file of the shard.

`tgi-vlm bench --profile` (or `py-spy record -f raw -p SHARD_PID`) writes one line per stack with
its sample count. This sums the samples of the Prefill and Decode RPCs (warmup excluded) under the
frames that matter for speed, as a share of each phase and of both together.

    .venv/bin/python benchmarks/profile_summary.py PROFILE.txt [--markdown]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

PHASES = {"prefill": "TextGenerationService._prefill", "decode": "TextGenerationService._decode"}
# label -> the function name(s) whose presence in a stack counts the sample
FRAMES = {
    "request intake (processor, tokenize)": "FlashCausalLM.batch_from_pb",
    "vision tower": ".encode",
    "text model forward": "TextModel.forward",
    "  attention (paged backend)": "TorchPagedBackend.forward",
    "    K/V gather (reference path)": "_gather",
    "    decode mirror copies": "DecodeMirror.sync_layer",
    "    SDPA": "_attend",
    "  RMSNorm": "RMSNorm.forward",
    "sampling + outputs": "FlashCausalLM.sample",
    # layers/linear/'s kernels and modules too
    "linear layers (text and vision)": ("Linear.forward", "_linear_forward", "KernelLinear.forward", "_product",
                                        "FusedProjections.output"),
    "patch-embedding convolution": "Conv3d.forward",
}


def summarize(path: Path) -> dict:
    totals = collections.Counter()
    frames = {phase: collections.Counter() for phase in PHASES}
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        for phase, marker in PHASES.items():
            if marker in names:
                totals[phase] += int(count)
                for label, needles in FRAMES.items():
                    needles = (needles,) if isinstance(needles, str) else needles
                    if any(needle in name for name in names for needle in needles):
                        frames[phase][label] += int(count)
    return dict(samples=dict(totals), frames={p: dict(c) for p, c in frames.items()})


def markdown(summary: dict, title: str) -> str:
    total = sum(summary["samples"].values()) or 1
    lines = [f"### {title}", "", "| frame | prefill | decode | both |", "|---|---:|---:|---:|"]
    prefill, decode = (summary["samples"].get(p, 0) or 1 for p in PHASES)
    lines.append(f"| (share of samples) | {prefill / total:.0%} | {decode / total:.0%} | 100% |")
    for label in FRAMES:
        a = summary["frames"]["prefill"].get(label, 0)
        b = summary["frames"]["decode"].get(label, 0)
        lines.append(f"| {label} | {a / prefill:.1%} | {b / decode:.1%} | {(a + b) / total:.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    print(markdown(summarize(args.profile), args.title or args.profile.name))


if __name__ == "__main__":
    main()
