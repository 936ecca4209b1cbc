"""tgi-vlm: a vision-language-model shard backend for text-generation-inference (TGI v3 protocol)."""

__version__ = "0.1.0"
