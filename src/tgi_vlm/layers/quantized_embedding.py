"""A token embedding whose table is a `GroupedInt8Weight` (a GGUF file's `token_embd`, often the lm-head's too).

It replaces the model's input embedding module (`set_input_embeddings`), so the table is held once, quantized, and
shared with a tied lm-head's kernel. A lookup de-quantizes only the rows asked for, to float32 (the format's exact
values), then casts to the model's dtype, as transformers' model (holding those values in its dtype) would give them.
transformers' scaled word embeddings (Gemma's: the lookup times `embed_scale`, in the weight's dtype) keep their
scale: `embed_scale` is read from the module replaced.
"""

from __future__ import annotations

import torch

from tgi_vlm.quantization.grouped import GroupedInt8Weight


class QuantizedEmbedding(torch.nn.Module):
    def __init__(self, table: GroupedInt8Weight, dtype: torch.dtype, embed_scale: torch.Tensor | None = None,
                 padding_idx: int | None = None):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.shape
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.embed_scale = embed_scale

    @classmethod
    def replacing(cls, module: torch.nn.Embedding, table: GroupedInt8Weight) -> QuantizedEmbedding:
        if table.shape != tuple(module.weight.shape):
            raise ValueError(f"a {table.source} table {table.shape} for an embedding of {tuple(module.weight.shape)}")
        scale = getattr(module, "embed_scale", None)
        return cls(table, module.weight.dtype, None if scale is None else torch.as_tensor(scale).detach().clone(),
                   module.padding_idx)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.dequantize(rows=input_ids.reshape(-1)).to(self.dtype)
        out = rows.view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.source}, dtype={self.dtype}"
