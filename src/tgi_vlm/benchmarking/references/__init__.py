"""References: the same requests through another implementation, for ratios and exact-output checks.

    transformers.py  transformers' own `generate`, in-process, static batches (the `--hf` reference)
"""
