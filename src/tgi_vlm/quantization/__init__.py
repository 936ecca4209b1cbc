"""Quantized checkpoints: their weights in the shard's one quantized form, and the files they come from.

grouped.py         `GroupedInt8Weight`: int8 codes, a float32 scale (and offset) per group of inputs
gguf_blocks.py     a GGUF tensor's blocks (Q8_0, Q5_0, Q4_K, Q6_K, ...) -> that form, exactly
gguf_checkpoint.py a `.gguf` model path: config, tokenizer and model through transformers, then its quantized
                   tensors attached to the linear layers and the embedding they belong to
packed_config.py   an AWQ / GPTQ / compressed-tensors `quantization_config`: what is served, each layer's scheme
packed_formats.py  one layer's packed tensors (qweight/qzeros/scales/g_idx, weight_packed/...) -> that form, exactly
packed_checkpoint.py such a model directory: built by transformers without its quantizer, packed layers attached
int8.py            `--quantize eetq`: a float checkpoint's linears int8 per output channel, at load
"""
