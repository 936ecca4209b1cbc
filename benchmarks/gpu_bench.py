"""Decode speed on a CUDA device: a Qwen2-VL-2B-shaped language model with random bf16 weights.

Built from transformers' config classes (no download). Reports decode tokens/s at batch 1/8/32
with and without CUDA graphs, their ratio, and the batch-1 step time against the HBM roofline
(bytes of weights read per step ÷ measured device-to-device copy bandwidth). Writes
gpu_bench.json and gpu_bench.md under --out. Usage: python benchmarks/gpu_bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from tgi_vlm.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    KVCacheSpec,
    PagedKVCache,
    flashinfer_available,
    make_backend,
    register_paged_attention,
)
from tgi_vlm.models.cuda_graphs import DecodeGraphs

BATCHES = (1, 8, 32)
CONTEXT = 512  # tokens already in the cache of every sequence
BLOCK = 16


def qwen2_vl_2b_config():
    from transformers import Qwen2VLConfig

    text = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    vision = dict(depth=2, embed_dim=256, hidden_size=1536, num_heads=4)  # unused here: keep it small
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)


def build_model():
    from transformers import Qwen2VLForConditionalGeneration

    name = register_paged_attention()
    config = qwen2_vl_2b_config()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2VLForConditionalGeneration._from_config(
            config, attn_implementation={"text_config": name, "vision_config": "sdpa"}, dtype=torch.bfloat16)
    return model.eval()


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bytes/s, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def decode_meta(kv_cache: PagedKVCache, backend, batch: int) -> AttentionMetadata:
    blocks_per_seq = (CONTEXT + 1 + BLOCK - 1) // BLOCK
    slot_index = torch.stack([
        torch.arange((1 + i * blocks_per_seq) * BLOCK, (1 + i * blocks_per_seq) * BLOCK + CONTEXT + 1) for i in range(batch)
    ]).cuda()
    group = DecodeGroup.build(list(range(batch)), [CONTEXT + 1] * batch, slot_index, num_tokens=batch)
    return AttentionMetadata(kv_cache=kv_cache, slots=slot_index[:, -1].contiguous(), decode=group, prefills=[],
                             backend=backend)


def time_steps(step, steps: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure(lm, head, graphs: DecodeGraphs, kv_cache: PagedKVCache, batch: int, steps: int) -> dict:
    meta = decode_meta(kv_cache, graphs.backend, batch)
    embeds = torch.randn(batch, lm.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    positions = torch.full((3, 1, batch), CONTEXT, device="cuda")

    def eager():
        meta.clear_masks()
        meta.backend.plan(meta)  # re-plan every step, as serving does
        hidden = lm(inputs_embeds=embeds[None], position_ids=positions, attn_metadata=meta,
                    use_cache=False).last_hidden_state[0]
        return head(hidden).argmax(-1)

    def graphed():
        plan = graphs.plan(meta)
        return head(graphs.replay(plan, embeds, positions, meta)).argmax(-1)

    t_eager, t_graph = time_steps(eager, steps), time_steps(graphed, steps)
    return dict(batch=batch, eager_step_ms=t_eager * 1e3, graph_step_ms=t_graph * 1e3,
                eager_tok_s=batch / t_eager, graph_tok_s=batch / t_graph, graph_speedup=t_eager / t_graph)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/gpu")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA device")
    backend = "flashinfer" if flashinfer_available() else "torch"
    model = build_model()
    lm, head = model.model.language_model, model.lm_head
    text = model.config.text_config
    spec = KVCacheSpec(text.num_hidden_layers, text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
                       BLOCK, torch.bfloat16)
    blocks = 2 + max(BATCHES) * ((CONTEXT + 1 + BLOCK - 1) // BLOCK)
    kv_cache = PagedKVCache(spec, blocks, "cuda")
    runner = SimpleNamespace(language_model=lm, text_config=text, dtype=torch.bfloat16, device=torch.device("cuda"),
                             kv_cache=kv_cache, position_rows=3, attention=make_backend(backend))
    weight_bytes = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    weight_bytes += head.weight.numel() * head.weight.element_size()
    bandwidth = copy_bandwidth()
    with torch.inference_mode():
        graphs = DecodeGraphs.capture(runner, BATCHES, max_kv_len=((CONTEXT + 1 + BLOCK - 1) // BLOCK) * BLOCK)
        rows = [measure(lm, head, graphs, kv_cache, batch, args.steps) for batch in BATCHES]
    roofline_ms = weight_bytes / bandwidth * 1e3
    result = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, attention=backend, context=CONTEXT,
                  weight_bytes=weight_bytes, copy_bandwidth_gb_s=bandwidth / 1e9, roofline_step_ms=roofline_ms,
                  batch1_graph_vs_roofline=rows[0]["graph_step_ms"] / roofline_ms, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    (out / "gpu_bench.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = [
        f"# Decode, Qwen2-VL-2B-shaped (random bf16), {r['device']}, attention={r['attention']}, context {r['context']}",
        "",
        "| batch | eager ms/step | graph ms/step | eager tok/s | graph tok/s | graph speed-up |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['batch']} | {row['eager_step_ms']:.2f} | {row['graph_step_ms']:.2f} | "
                     f"{row['eager_tok_s']:.0f} | {row['graph_tok_s']:.0f} | {row['graph_speedup']:.2f}× |")
    lines += ["", f"Weights read per step: {r['weight_bytes'] / 1e9:.2f} GB; measured copy bandwidth "
              f"{r['copy_bandwidth_gb_s']:.0f} GB/s; roofline {r['roofline_step_ms']:.3f} ms/step; batch-1 graph step "
              f"is {r['batch1_graph_vs_roofline']:.2f}× the roofline.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
