"""What a checkpoint's `quantization_config` says: AWQ, GPTQ or compressed-tensors, and each layer's scheme.

`PackedQuantization.from_config(dict, where)` reads the `quantization_config` of a model's config.json (a VLM may
carry it in its text_config) as TGI does, and refuses at start, naming the file and the key, what the shard does not
serve: another `quant_method` (bitsandbytes, fp8, exl2, ...), AWQ other than GEMM 4-bit with zero points, GPTQ codes
other than 4 or 8 bits or its Marlin format, compressed-tensors formats other than `pack-quantized` integer weights,
and quantized activations (W8A8: its definition quantizes each token's activations to int8 on the fly; this shard
keeps activations in the model's dtype, so it refuses rather than serve a different model).

`scheme_for(name)` says how one linear layer (its checkpoint name; a VLM's model name too) is stored, or None where it
stays in the model's dtype: AWQ's `modules_to_not_convert` (a substring of the name), GPTQ's `dynamic` overrides
(`-:regex` skips, `+:regex` / `regex` overrides bits, group_size, sym, desc_act) and `modules_in_block_to_quantize`,
compressed-tensors' `ignore` (names, `re:` patterns) and its `config_groups` targets (class names, names, `re:`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

METHODS = ("awq", "gptq", "compressed-tensors")
CT_PACKED_FORMATS = ("pack-quantized",)


class PackedCheckpointError(ValueError):
    """A quantized checkpoint the shard cannot serve as it is; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class LayerScheme:
    """How one layer's weight is stored: `bits`-bit codes, a scale (and a zero point unless `symmetric`) per
    `group` inputs (-1: one group per row), in activation order where `act_order` (GPTQ desc_act: its g_idx)."""

    bits: int
    group: int
    symmetric: bool
    act_order: bool = False

    def label(self, method: str) -> str:
        """The kernel's name for it in the plan's log: "gptq 4-bit g128 asym"."""
        group = "row" if self.group == -1 else f"g{self.group}"
        return f"{method} {self.bits}-bit {group}{'' if self.symmetric else ' asym'}{' act-order' if self.act_order else ''}"


@dataclass(frozen=True)
class PackedQuantization:
    method: str  # one of METHODS
    default: LayerScheme | None  # AWQ / GPTQ: every quantized layer's scheme unless overridden
    where: str  # the file (and key) it came from, for messages
    gptq_zeros_minus_one: bool = True  # GPTQ's classic format stores zero - 1 (checkpoint_format "gptq"); v2 does not
    not_converted: tuple[str, ...] = ()  # AWQ modules_to_not_convert: substrings
    dynamic: tuple[tuple[str, dict], ...] = ()  # GPTQ per-module rules, in order
    block_modules: tuple[str, ...] = ()  # GPTQ modules_in_block_to_quantize, flattened; empty: every linear
    ignore: tuple[str, ...] = ()  # compressed-tensors: names or "re:" patterns
    groups: tuple[tuple[tuple[str, ...], LayerScheme], ...] = field(default_factory=tuple)  # CT targets -> scheme

    @classmethod
    def from_config(cls, config: dict, where: str) -> PackedQuantization:
        method = str(config.get("quant_method", "")).lower()
        readers = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}
        if method not in readers:
            raise PackedCheckpointError(f"{where}: quantization_config.quant_method {method!r} is not served (served: "
                                        f"{', '.join(METHODS)}, and GGUF files)")
        return readers[method](config, where)

    def scheme_for(self, *names: str) -> LayerScheme | None:
        """The scheme of the linear layer called `names` (its checkpoint name, and its model name where that
        differs), or None where the config keeps it unquantized."""
        if self.method == "awq":
            return None if any(n in name for n in self.not_converted for name in names) else self.default
        if self.method == "gptq":
            return self._gptq_scheme(names)
        if any(_ct_matches(entry, name) for entry in self.ignore for name in names):
            return None
        # compressed-tensors' own precedence: a target naming the layer, then a `re:` pattern, then the class name,
        # whatever the order of the groups (a mixed-precision config lists a "Linear" group and specific ones)
        for rank in (_exact_target, _regex_target, _class_target):
            for targets, scheme in self.groups:
                if any(rank(t, name) for t in targets for name in names):
                    return scheme
        return None

    def _gptq_scheme(self, names: tuple[str, ...]) -> LayerScheme | None:
        if self.block_modules and ".layers." in names[0] and not any(
                name.endswith("." + m) for m in self.block_modules for name in names):
            return None
        for pattern, override in self.dynamic:
            negative = pattern.startswith("-:")
            regex = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
            if any(re.match(regex, name) for name in names):
                if negative:
                    return None
                bits = _int(override, "bits", f"{self.where} dynamic[{pattern!r}]", self.default.bits)
                _need(bits in (4, 8), f"{self.where} dynamic[{pattern!r}]",
                      f"GPTQ with {bits}-bit codes is not served (4 or 8 bits)")
                return replace(self.default, bits=bits,
                               group=_int(override, "group_size", f"{self.where} dynamic[{pattern!r}]",
                                          self.default.group),
                               symmetric=bool(override.get("sym", self.default.symmetric)),
                               act_order=bool(override.get("desc_act", self.default.act_order)))
        return self.default


def _ct_matches(entry: str, name: str) -> bool:
    return re.match(entry[3:], name) is not None if entry.startswith("re:") else entry == name


def _exact_target(target: str, name: str) -> bool:
    return not target.startswith("re:") and target == name


def _regex_target(target: str, name: str) -> bool:
    return target.startswith("re:") and re.match(target[3:], name) is not None


def _class_target(target: str, name: str) -> bool:
    return target == "Linear"


def _int(config: dict, key: str, where: str, default: int | None = None) -> int:
    """`config[key]` as an int (`default` where absent), refused by name where it is null or not a number."""
    value = config.get(key, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PackedCheckpointError(f"{where}: {key} {value!r} is not an integer") from None


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise PackedCheckpointError(f"{where}: {what}")


def _awq(config: dict, where: str) -> PackedQuantization:
    version = str(config.get("version") or config.get("format") or "gemm").lower()  # AutoAWQ: version; GPTQModel: format
    _need(version == "gemm", where, f"AWQ version {version!r} is not served (only GEMM: 'version': 'gemm')")
    bits = _int(config, "bits" if "bits" in config else "w_bit", where, 4)
    _need(bits == 4, where, f"AWQ with {bits}-bit codes is not served (4-bit only)")
    _need(bool(config.get("zero_point", True)), where, "AWQ without zero points (zero_point false) is not served")
    group = _int(config, "group_size" if "group_size" in config else "q_group_size", where, 128)
    return PackedQuantization("awq", LayerScheme(4, group, symmetric=False), where,
                              not_converted=tuple(config.get("modules_to_not_convert") or ()))


def _gptq(config: dict, where: str) -> PackedQuantization:
    bits = _int(config, "bits", where, 4)
    _need(bits in (4, 8), where, f"GPTQ with {bits}-bit codes is not served (4 or 8 bits)")
    # transformers' precedence: checkpoint_format, else format (GPTQModel writes "format": "gptq_v2"), else classic
    fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    _need(fmt in ("gptq", "gptq_v2"), where, f"GPTQ checkpoint_format {fmt!r} is not served ('gptq', 'gptq_v2')")
    scheme = LayerScheme(bits, _int(config, "group_size", where, 128), symmetric=bool(config.get("sym", True)),
                         act_order=bool(config.get("desc_act", False)))
    for pattern, override in (config.get("dynamic") or {}).items():  # checked here, at start, not when a layer asks
        at = f"{where} dynamic[{pattern!r}]"
        _need(isinstance(override, dict), at, f"an override must be a mapping, got {override!r}")
        override_bits = _int(override, "bits", at, bits)
        _need(override_bits in (4, 8), at, f"GPTQ with {override_bits}-bit codes is not served (4 or 8 bits)")
        _int(override, "group_size", at, 128)
    blocks = config.get("modules_in_block_to_quantize") or ()
    flat = tuple(m for part in blocks for m in (part if isinstance(part, list) else [part]))
    return PackedQuantization("gptq", scheme, where, gptq_zeros_minus_one=fmt == "gptq",
                              dynamic=tuple((config.get("dynamic") or {}).items()), block_modules=flat)


def _compressed_tensors(config: dict, where: str) -> PackedQuantization:
    top_format = config.get("format")
    # Parts of a compressed-tensors config that change what the weights mean or how they are stored: serving
    # without them would be another model (online rotations), or misread the weights (sparse storage).
    for key, what in (("transform_config", "online transforms (rotations applied at run time)"),
                      ("sparsity_config", "sparse weight storage")):
        _need(not config.get(key), where, f"{key}: {what} are not served")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        at = f"{where} config_groups.{name}"
        fmt = group.get("format") or top_format
        _need(fmt in CT_PACKED_FORMATS, at, f"compressed-tensors format {fmt!r} is not served (served: "
                                            f"{', '.join(CT_PACKED_FORMATS)} integer weights, W4A16 / W8A16)")
        _need(not group.get("input_activations"), at, "quantized input activations (W8A8 / W4A8: int8 activations "
              "per token at run time) are not served: this shard keeps activations in the model's dtype; a "
              "weight-only scheme (W4A16, W8A16) is")
        weights = group.get("weights") or {}
        _need(weights.get("type", "int") == "int" and _int(weights, "num_bits", at, 0) in (4, 8), at,
              f"weights {weights.get('type')} {weights.get('num_bits')}-bit are not served (int 4 or 8 bits)")
        strategy = weights.get("strategy")
        _need(strategy in ("group", "channel"), at, f"weight strategy {strategy!r} is not served (group, channel)")
        group_size = _int(weights, "group_size", at) if strategy == "group" else -1
        act_order = weights.get("actorder") == "group"  # then its weight_g_idx names each input's group
        groups.append((tuple(group.get("targets") or ()), LayerScheme(
            int(weights["num_bits"]), group_size, symmetric=bool(weights.get("symmetric", True)), act_order=act_order)))
    _need(bool(groups), where, "compressed-tensors config without config_groups: nothing to read")
    return PackedQuantization("compressed-tensors", None, where, ignore=tuple(config.get("ignore") or ()),
                              groups=tuple(groups))
