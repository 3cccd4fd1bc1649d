"""What a checkpoint's ``quantization_config`` (config.json) says about its weights, checked once.

Recognised layouts (the tensors each one stores are read by backends/torch/quant_weights.py):

- ``compressed-tensors`` ``float-quantized`` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): e4m3 ``weight``
  with ``weight_scale`` per tensor ``[1]``, per output channel ``[out, 1]`` or per block ``[out/bh, in/bw]``;
  ``input_scale`` (static activations) is read and not used: activations stay 16-bit.
- ``compressed-tensors`` ``pack-quantized`` (llm-compressor's W4A16 / W8A16, GPTQ or RTN): ``weight_packed``
  (int32, eight 4-bit values per word along the input dim, stored +8), ``weight_scale`` ``[out, groups]``,
  optional ``weight_zero_point`` (packed along the output dim) and ``weight_g_idx`` (activation order).
- ``fp8`` (DeepSeek-V3, Qwen3-*-FP8): e4m3 ``weight`` with ``weight_scale_inv`` ``[out/128, in/128]`` when
  ``weight_block_size`` is given, else a per-tensor ``weight_scale``.
- ``awq`` (AutoAWQ GEMM): ``qweight`` ``[in, out/8]`` (int32, output columns in the order 0 2 4 6 1 3 5 7
  within a word), ``qzeros`` ``[in/g, out/8]`` packed the same way, ``scales`` ``[in/g, out]``.
- ``gptq`` (AutoGPTQ / GPTQModel): ``qweight`` ``[in*bits/32, out]`` (packed along the input dim, low bits
  first), ``qzeros`` ``[groups, out*bits/32]``, ``scales`` ``[groups, out]``, ``g_idx`` ``[in]``; the original
  ``checkpoint_format: gptq`` stores each zero point minus one (added back here), ``gptq_v2`` stores it as is.

Anything else is refused with one sentence naming the setting (``UnsupportedArchitecture``).  This module
never imports torch: ``swiftlm info`` and the registry describe a checkpoint through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import UnsupportedArchitecture

INT_BITS = (4, 8)  # packed integer widths read (2- and 3-bit packs are refused)


@dataclass(frozen=True)
class QuantScheme:
    """One checkpoint's weight format.  ``kind``: "fp8" (float e4m3 weights and scales) or "int" (packed
    integer weights, group-wise scales and zero points); ``layout``: which tensors hold them ("compressed-
    tensors", "fp8-block", "fp8-tensor", "awq", "gptq", "packed")."""

    kind: str
    layout: str
    method: str  # quant_method as written in config.json
    bits: int
    strategy: str = "group"  # fp8: "tensor" | "channel" | "block"; int: "group" | "channel"
    group_size: int = 0  # int: input columns per scale (0: the whole row, per output channel)
    block: tuple[int, int] | None = None  # fp8 block scales: (rows, columns) per scale
    symmetric: bool = True
    act_order: bool = False  # int: a g_idx permutes columns into groups
    zero_offset: int = 0  # GPTQ's original format stores each zero point minus this
    activations: str = "16-bit"  # what the checkpoint asks for activations (informational on the dequantised path)

    def describe(self) -> str:
        """A short phrase for ``swiftlm info`` and ModelInfo.quantization: "fp8 e4m3, per-channel scales
        (compressed-tensors)", "int4, group 128, zero points (awq)"."""
        if self.kind == "fp8":
            how = f"{self.block[0]}x{self.block[1]} block" if self.block else f"per-{self.strategy}"
            return f"fp8 e4m3, {how} scales ({self.method})"
        parts = [f"int{self.bits}", f"group {self.group_size}" if self.group_size else "per-channel"]
        if not self.symmetric:
            parts.append("zero points")
        if self.act_order:
            parts.append("act-order")
        src = self.method if self.layout != "packed" else "compressed-tensors pack-quantized"
        return f"{', '.join(parts)} ({src})"


def _refuse(setting: str, value: Any, why: str = "") -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"quantization_config.{setting}={value!r} is not supported by swiftlm's quantized-weight reader"
        + (f" ({why})" if why else "")
    )


def parse(config: dict) -> QuantScheme | None:
    """The weight format ``config`` (a config.json) declares, None for 16-bit weights; MLX's own
    ``quantization`` block is not this (the mlx backend reads it).  Raises UnsupportedArchitecture, one
    sentence naming the setting, for a layout the reader does not implement."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None or _is_mlx(config, qc):
        return None
    if not isinstance(qc, dict):
        raise _refuse("", qc, "not a JSON object")
    method = str(qc.get("quant_method") or "").lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8(qc)
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    raise _refuse(
        "quant_method",
        qc.get("quant_method"),
        "readable layouts: compressed-tensors (float-quantized, pack-quantized), fp8, awq, gptq",
    )


def _is_mlx(config: dict, qc: Any) -> bool:
    """mlx-lm writes its own ``quantization`` block and mirrors it as ``quantization_config`` (no quant_method):
    MLX's format, which the mlx backend reads and the torch backend refuses on its own."""
    mlx = config.get("quantization")
    return (isinstance(mlx, dict) and "bits" in mlx) or (
        isinstance(qc, dict) and "quant_method" not in qc and "bits" in qc and "group_size" in qc
    )


def _group(value: Any, setting: str) -> int:
    g = -1 if value is None else int(value)
    if g == -1:
        return 0
    if g <= 0:
        raise _refuse(setting, value, "a positive number of input columns, or -1 for one group per row")
    return g


def _awq(qc: dict) -> QuantScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", qc.get("version"), "only AutoAWQ's GEMM layout is read")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ checkpoints are read at 4 bits")
    if not qc.get("zero_point", True):
        raise _refuse("zero_point", qc.get("zero_point"), "AutoAWQ's GEMM layout stores zero points")
    g = _group(qc.get("group_size", qc.get("q_group_size", 128)), "group_size")
    return QuantScheme("int", "awq", "awq", bits, "group" if g else "channel", g, symmetric=False)


def _gptq(qc: dict) -> QuantScheme:
    bits = int(qc.get("bits", 4))
    if bits not in INT_BITS:
        raise _refuse("bits", bits, f"GPTQ checkpoints are read at {' or '.join(map(str, INT_BITS))} bits")
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", qc.get("checkpoint_format"), "readable: gptq, gptq_v2")
    if qc.get("dynamic"):
        raise _refuse("dynamic", "{...}", "per-module bit widths are not read")
    g = _group(qc.get("group_size", 128), "group_size")
    return QuantScheme(
        "int",
        "gptq",
        "gptq",
        bits,
        "group" if g else "channel",
        g,
        symmetric=bool(qc.get("sym", True)),
        act_order=bool(qc.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _fp8(qc: dict) -> QuantScheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse("fmt", qc.get("fmt"), "fp8 weights are read as e4m3")
    scheme = str(qc.get("activation_scheme", "dynamic"))
    if scheme not in ("dynamic", "static"):
        raise _refuse("activation_scheme", scheme, "dynamic or static")
    block = qc.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8", "fp8-tensor", "fp8", 8, "tensor", activations=f"fp8 {scheme}")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise _refuse("weight_block_size", block, "two positive integers")
    return QuantScheme(
        "fp8", "fp8-block", "fp8", 8, "block", block=(int(block[0]), int(block[1])), activations=f"fp8 {scheme}"
    )


def _compressed_tensors(qc: dict) -> QuantScheme:
    fmt = str(qc.get("format") or "")
    if qc.get("sparsity_config") or qc.get("transform_config"):
        key = "sparsity_config" if qc.get("sparsity_config") else "transform_config"
        raise _refuse(key, "{...}", "sparse and transformed weights are not read")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "only compressed checkpoints are read")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("config_groups", groups, "no weight scheme")
    schemes = []
    for name, g in groups.items():
        w = (g or {}).get("weights")
        if not w:
            raise _refuse(f"config_groups.{name}.weights", w, "activation-only quantization is not read")
        group_fmt = g.get("format") or fmt
        schemes.append(_ct_weights(f"config_groups.{name}", w, group_fmt, g.get("input_activations")))
    if len(set(schemes)) > 1:
        raise _refuse("config_groups", sorted(groups), "groups with different weight schemes are not read")
    return schemes[0]


def _ct_weights(where: str, w: dict, fmt: str, act: dict | None) -> QuantScheme:
    kind, bits = str(w.get("type", "int")), int(w.get("num_bits", 8))
    strategy = str(w.get("strategy") or "tensor")
    if w.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic", w["dynamic"], "weights must carry their scales")
    acts = "16-bit"
    if act:
        acts = f"{act.get('type', 'int')}{act.get('num_bits', 8)} {'dynamic' if act.get('dynamic') else 'static'}"
    if kind == "float":
        if fmt != "float-quantized" and fmt != "naive-quantized":
            raise _refuse("format", fmt, "fp8 weights are read from float-quantized checkpoints")
        if bits != 8:
            raise _refuse(f"{where}.weights.num_bits", bits, "float weights are read as fp8 e4m3")
        if not w.get("symmetric", True):
            raise _refuse(f"{where}.weights.symmetric", False, "fp8 weights are read without zero points")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(f"{where}.weights.strategy", strategy, "fp8 scales: tensor, channel or block")
        block = None
        if strategy == "block":
            bs = w.get("block_structure")
            if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(int(b) > 0 for b in bs)):
                raise _refuse(f"{where}.weights.block_structure", bs, "two positive integers")
            block = (int(bs[0]), int(bs[1]))
        return QuantScheme(
            "fp8", "compressed-tensors", "compressed-tensors", 8, strategy, block=block, activations=acts
        )
    if kind != "int":
        raise _refuse(f"{where}.weights.type", kind, "int or float")
    if fmt != "pack-quantized":
        raise _refuse("format", fmt, "integer weights are read from pack-quantized checkpoints")
    if bits not in INT_BITS:
        raise _refuse(
            f"{where}.weights.num_bits", bits, f"packed weights are read at {' or '.join(map(str, INT_BITS))} bits"
        )
    if strategy not in ("group", "channel"):
        raise _refuse(f"{where}.weights.strategy", strategy, "integer scales: group or channel")
    g = _group(w.get("group_size"), f"{where}.weights.group_size") if strategy == "group" else 0
    actorder = w.get("actorder")
    return QuantScheme(
        "int",
        "packed",
        "compressed-tensors",
        bits,
        strategy,
        g,
        symmetric=bool(w.get("symmetric", True)),
        act_order=actorder in ("group", "weight", True),
        activations=acts,
    )


def describe(config: dict) -> str | None:
    """``parse(config).describe()``, the refusal's sentence for an unreadable layout, None for none."""
    try:
        s = parse(config)
    except UnsupportedArchitecture as exc:
        qc = config.get("quantization_config") or {}
        return f"{qc.get('quant_method', 'quantized') if isinstance(qc, dict) else 'quantized'} (unreadable: {exc})"
    return s.describe() if s else None
