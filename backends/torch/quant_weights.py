"""A quantized checkpoint's tensors -> the plain ``<module>.weight`` tensors the native model loads.

``dequantize_state`` finds each quantized linear layer by the tensors its layout stores (quant_config.py
lists them), checks their shapes against the declared scheme (a group size that does not divide a layer's
input columns is refused in one sentence naming the setting), and replaces them with the dequantised
weight in the load dtype, one layer at a time (peak: the checkpoint plus one float matrix).  Tensors that
only serve quantized activations or a quantized KV cache (``input_scale``, ``k_scale``, ...) are dropped:
on this path activations and the KV cache stay in the model dtype.

This is the CPU path and the reference: correct, not fast.  A GPU path that keeps the weights packed
reads the same tensors through ``quantized_layers`` and is checked against ``dequantize_state``.
"""

from __future__ import annotations

import torch

from swiftlm.errors import CorruptModel, UnsupportedArchitecture
from swiftlm.quant_config import QuantScheme

from . import quant_unpack as U

# per-layer tensors of each layout besides the one that names the layer
_INT_MARK = {"awq": "qweight", "gptq": "qweight", "packed": "weight_packed"}
DROPPED = (
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "output_zero_point",
    "k_scale",
    "v_scale",
    "q_scale",
    "kv_scale",
    "prob_scale",
)


def quantized_layers(state: dict[str, torch.Tensor], scheme: QuantScheme) -> list[str]:
    """The module names (``model.layers.0.self_attn.q_proj``) whose weight ``state`` stores quantized."""
    if scheme.kind == "fp8":
        return [
            k[: -len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dtype == torch.float8_e4m3fn
        ]
    mark = "." + _INT_MARK[scheme.layout]
    return [k[: -len(mark)] for k in state if k.endswith(mark)]


def dequantize_state(
    state: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """``state`` with every quantized layer's tensors replaced by ``<module>.weight`` in ``dtype`` (in place;
    returned for chaining)."""
    layers = quantized_layers(state, scheme)
    if not layers:
        raise CorruptModel(
            f"config.json declares {scheme.describe()} weights but no tensor of that layout is in the checkpoint"
        )
    for m in layers:
        state[m + ".weight"] = _one(state, m, scheme).to(dtype)
    for k in [k for k in state if k.rsplit(".", 1)[-1] in DROPPED]:
        del state[k]
    stray = [k for k in state if state[k].dtype == torch.float8_e4m3fn or k.endswith((".qweight", ".weight_packed"))]
    if stray:
        raise CorruptModel(f"tensor {stray[0]} is quantized but not laid out as {scheme.describe()} declares")
    return state


def _take(state: dict[str, torch.Tensor], m: str, name: str, required: bool = True) -> torch.Tensor | None:
    t = state.pop(f"{m}.{name}", None)
    if t is None and required:
        raise CorruptModel(f"quantized layer {m} has no {name} tensor, which its layout needs")
    return t


def _check_group(m: str, cols: int, scheme: QuantScheme, setting: str) -> None:
    if scheme.group_size and cols % scheme.group_size:
        raise UnsupportedArchitecture(
            f"quantization_config {setting}={scheme.group_size} does not divide the {cols} input columns of {m}"
        )


def _one(state: dict[str, torch.Tensor], m: str, s: QuantScheme) -> torch.Tensor:
    if s.kind == "fp8":
        w = _take(state, m, "weight")
        scale = _take(state, m, "weight_scale_inv" if s.layout == "fp8-block" else "weight_scale", required=False)
        if scale is None:  # either name, whichever the writer used
            scale = _take(state, m, "weight_scale" if s.layout == "fp8-block" else "weight_scale_inv")
        if s.block is not None:
            bh, bw = s.block
            want = (-(-w.shape[0] // bh), -(-w.shape[1] // bw))
            if tuple(scale.shape) != want:
                raise CorruptModel(f"{m}'s block scale has shape {tuple(scale.shape)}, not {want} for {bh}x{bw} blocks")
        return U.fp8_weight(w, scale, s.block)
    if s.layout == "awq":
        qweight, qzeros, scales = (_take(state, m, n) for n in ("qweight", "qzeros", "scales"))
        _check_group(m, qweight.shape[0], s, "group_size")
        _check_shapes(m, s, qweight.shape[0], scales, qzeros.shape, (scales.shape[0], qweight.shape[1]))
        return U.awq_weight(qweight, qzeros, scales, s.group_size)
    if s.layout == "gptq":
        qweight, scales = _take(state, m, "qweight"), _take(state, m, "scales")
        qzeros, g_idx = _take(state, m, "qzeros", required=False), _take(state, m, "g_idx", required=False)
        cols = qweight.shape[0] * 32 // s.bits
        _check_group(m, cols, s, "group_size")
        if qzeros is not None:
            _check_shapes(m, s, cols, scales, qzeros.shape, (scales.shape[0], scales.shape[1] * s.bits // 32))
        if g_idx is not None and g_idx.shape[0] != cols:
            raise CorruptModel(f"{m}.g_idx has {g_idx.shape[0]} entries for {cols} input columns")
        if g_idx is not None and g_idx.numel() and int(g_idx.max()) >= scales.shape[0]:
            raise CorruptModel(f"{m}.g_idx names group {int(g_idx.max())} of {scales.shape[0]}")
        return U.gptq_weight(qweight, qzeros, scales, g_idx, s.bits, s.group_size, s.zero_offset)
    packed, scale = _take(state, m, "weight_packed"), _take(state, m, "weight_scale")
    shape_t = _take(state, m, "weight_shape", required=False)
    shape = (
        (int(shape_t[0]), int(shape_t[1])) if shape_t is not None else (packed.shape[0], packed.shape[1] * 32 // s.bits)
    )
    zp = _take(state, m, "weight_zero_point", required=not s.symmetric)
    g_idx = _take(state, m, "weight_g_idx", required=False)
    _check_group(m, shape[1], s, "config_groups.*.weights.group_size")
    return U.packed_weight(packed, scale, shape, s.bits, s.group_size, zp if not s.symmetric else None, g_idx)


def _check_shapes(m: str, s: QuantScheme, cols: int, scales: torch.Tensor, zshape: tuple, zwant: tuple) -> None:
    groups = cols // s.group_size if s.group_size else 1
    if scales.shape[0] != groups or tuple(zshape) != tuple(zwant):
        raise CorruptModel(
            f"quantized layer {m} has scales {tuple(scales.shape)} and zeros {tuple(zshape)}, which do not "
            f"match {cols} input columns at {s.describe()}"
        )
