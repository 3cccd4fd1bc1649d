#!/usr/bin/env python3
"""Quantize a 16/32-bit HF checkpoint's linear layers into one of the layouts people download, or write
the 16-bit checkpoint those quantized weights stand for.

    python scripts/quantize_checkpoint.py SRC OUT --format FORMAT [--group-size 32] [--dequantized]

FORMAT (the tensors each writes: swiftlm/quant_config.py):
  fp8-tensor, fp8-channel, fp8-block   compressed-tensors float-quantized (written by the compressed-tensors
                                       package: its FP8 / FP8_DYNAMIC / FP8_BLOCK presets)
  fp8-deepseek                         quant_method fp8, weight_block_size [128, 128], weight_scale_inv
  awq                                  AutoAWQ GEMM, 4-bit, zero points (by hand, after AutoAWQ's packing)
  gptq, gptq-act-order, gptq-8bit      GPTQ, symmetric, original checkpoint_format (zero points stored
                                       minus one); act-order draws a column order and writes its g_idx
  gptq-v2-asym                         GPTQ, asymmetric, checkpoint_format gptq_v2 (zero points as they are)
  w4a16                                compressed-tensors pack-quantized, asymmetric (by the package)

``--dequantized``: the same weights dequantised by the writer's own arithmetic on the integer codes (or
by compressed-tensors' decompressor for its formats) into a plain checkpoint of SRC's dtype: the reference
a reader must reproduce.  Quantization is round-to-nearest with min/max scales (no calibration): these
checkpoints test layouts, not quantization quality.  Embeddings, norms and the LM head stay 16-bit, as in
published checkpoints.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

FORMATS = (
    "fp8-tensor",
    "fp8-channel",
    "fp8-block",
    "fp8-deepseek",
    "awq",
    "gptq",
    "gptq-act-order",
    "gptq-8bit",
    "gptq-v2-asym",
    "w4a16",
)
LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
FP8_MAX = 448.0
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS


# --------------------------------------------------------------------------- compressed-tensors (the package)
def _ct_scheme(fmt: str, group: int):
    from compressed_tensors.quantization import preset_name_to_scheme

    preset = {"fp8-tensor": "FP8", "fp8-channel": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "w4a16": "W4A16_ASYM"}[fmt]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if fmt == "w4a16":
        scheme.weights.group_size = group
    return scheme


def _ct_config(fmt: str, group: int) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    q = QuantizationConfig(
        config_groups={"group_0": _ct_scheme(fmt, group)},
        format="pack-quantized" if fmt == "w4a16" else "float-quantized",
        ignore=["lm_head"],
        quantization_status="compressed",
    )
    return q.model_dump(exclude_none=True)


def _ct_layer(w: torch.Tensor, fmt: str, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(compressed tensors by local name, the decompressor's own dequantised weight)."""
    from compressed_tensors.compressors import BaseCompressor

    scheme = _ct_scheme(fmt, group)
    out, cols = w.shape
    sd: dict[str, torch.Tensor] = {"weight": w}
    if fmt == "fp8-tensor":
        sd["weight_scale"] = (w.abs().amax() / FP8_MAX).reshape(1)
        sd["input_scale"] = torch.tensor([0.02])  # static activation scale: read, unused on the dequantised path
    elif fmt == "fp8-channel":
        sd["weight_scale"] = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    elif fmt == "fp8-block":
        bh, bw = scheme.weights.block_structure
        sd["weight_scale"] = _block_amax(w, bh, bw) / FP8_MAX
    else:  # asymmetric int4, group-wise
        g = w.reshape(out, cols // group, group)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        sd["weight_scale"] = scale
        sd["weight_zero_point"] = (torch.round(-lo / scale) - 8).clamp(-8, 7).to(torch.int8)
    fmt_name = "pack-quantized" if fmt == "w4a16" else "float-quantized"
    comp = BaseCompressor.get_value_from_registry(fmt_name)
    packed = comp.compress(sd, scheme)
    deq = comp.decompress(dict(packed), scheme)["weight"]
    packed = {k: v for k, v in packed.items()}
    return packed, deq.to(torch.float32)


def _block_amax(w: torch.Tensor, bh: int, bw: int) -> torch.Tensor:
    out, cols = w.shape
    ro, rc = -(-out // bh), -(-cols // bw)
    p = torch.zeros(ro * bh, rc * bw)
    p[:out, :cols] = w.abs()
    return p.reshape(ro, bh, rc, bw).amax(dim=(1, 3))


# --------------------------------------------------------------------------- fp8 method (DeepSeek / Qwen3-FP8)
def _fp8_block_layer(w: torch.Tensor, block: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    out, cols = w.shape
    scale_inv = (_block_amax(w, block, block) / FP8_MAX).clamp(min=1e-12)
    full = scale_inv.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = FP8BlockDequantizer(weight_block_size=(block, block), dtype=torch.float32)._create_dequantized_weight(
        q, scale_inv
    )
    return {"weight": q, "weight_scale_inv": scale_inv}, deq


# --------------------------------------------------------------------------- AutoAWQ GEMM (by hand)
def _pack_cols(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[rows, n] codes -> [rows, n * bits / 32] int32, code i of each word at bits*i (AWQ: a column order)."""
    per = 32 // bits
    rows, n = codes.shape
    c = codes.to(torch.int64).reshape(rows, n // per, per)
    if order is not None:
        c = c[:, :, list(order)]
    word = torch.zeros(rows, n // per, dtype=torch.int64)
    for i in range(per):
        word |= c[:, :, i] << (bits * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement: the top bit is the sign


def _awq_layer(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, cols = w.shape
    wt = w.t().reshape(cols // group, group, out)  # AutoAWQ works on [in, out]
    lo, hi = wt.amin(1), wt.amax(1)  # [in/g, out]
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()  # stored fp16: quantize against what is stored
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = (torch.round(wt / scales[:, None]) + zeros[:, None]).clamp(0, 15).reshape(cols, out)
    deq = ((q.reshape(cols // group, group, out) - zeros[:, None]) * scales[:, None]).reshape(cols, out).t()
    t = {
        "qweight": _pack_cols(q.to(torch.int32), 4, AWQ_ORDER),
        "qzeros": _pack_cols(zeros.to(torch.int32), 4, AWQ_ORDER),
        "scales": scales.half(),
    }
    return t, deq.contiguous()


# --------------------------------------------------------------------------- GPTQ (by hand)
def _gptq_layer(
    w: torch.Tensor, group: int, bits: int, act_order: bool, gen: torch.Generator, v2_asym: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric (zero point 2^(bits-1)) in the original format, which stores each zero point minus one; or
    (``v2_asym``) min/max zero points per group stored as they are (``checkpoint_format: gptq_v2``)."""
    out, cols = w.shape
    maxq = (1 << bits) - 1
    mid = 1 << (bits - 1)
    # act-order: GPTQ quantizes columns by decreasing Hessian diagonal and groups them in that order
    perm = torch.randperm(cols, generator=gen) if act_order else torch.arange(cols)
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[perm] = (torch.arange(cols) // group).to(torch.int32)
    groups = cols // group
    scales = torch.empty(groups, out)
    zeros = torch.full((groups, out), mid, dtype=torch.int32)
    for g in range(groups):
        cols_g = w[:, g_idx == g]
        if v2_asym:
            lo, hi = cols_g.amin(dim=1).clamp(max=0), cols_g.amax(dim=1).clamp(min=0)
            scales[g] = ((hi - lo) / maxq).clamp(min=1e-5)
            zeros[g] = torch.round(-lo / scales[g].half().float()).clamp(0, maxq).to(torch.int32)
        else:
            scales[g] = cols_g.abs().amax(dim=1).clamp(min=1e-5) / (maxq - mid)
    scales = scales.half().float()
    s_col, z_col = scales[g_idx.long()], zeros[g_idx.long()]  # [in, out]
    q = (torch.round(w.t() / s_col) + z_col).clamp(0, maxq)  # [in, out]
    deq = ((q - z_col) * s_col).t().contiguous()
    if not v2_asym:
        zeros = zeros - 1  # the original format stores z - 1
    t = {
        "qweight": _pack_cols(q.to(torch.int32).t().contiguous(), bits).t().contiguous(),
        "qzeros": _pack_cols(zeros, bits),
        "scales": scales.half(),
        "g_idx": g_idx,
    }
    return t, deq


# --------------------------------------------------------------------------- driver
def quant_config(fmt: str, group: int) -> dict:
    if fmt.startswith("fp8-") and fmt != "fp8-deepseek" or fmt == "w4a16":
        return _ct_config(fmt, group)
    if fmt == "fp8-deepseek":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq",
        "bits": 8 if fmt == "gptq-8bit" else 4,
        "group_size": group,
        "desc_act": fmt == "gptq-act-order",
        "sym": fmt != "gptq-v2-asym",
        "checkpoint_format": "gptq_v2" if fmt == "gptq-v2-asym" else "gptq",
        "damp_percent": 0.01,
        "true_sequential": True,
    }


def quantize_layer(
    w: torch.Tensor, fmt: str, group: int, gen: torch.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if fmt == "fp8-deepseek":
        return _fp8_block_layer(w)
    if fmt == "awq":
        return _awq_layer(w, group)
    if fmt.startswith("gptq"):
        return _gptq_layer(
            w, group, 8 if fmt == "gptq-8bit" else 4, fmt == "gptq-act-order", gen, fmt == "gptq-v2-asym"
        )
    return _ct_layer(w, fmt, group)


def convert(src: Path, out: Path, fmt: str, group: int = 32, dequantized: bool = False, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise SystemExit(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    cfg = json.loads((src / "config.json").read_text())
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.get("torch_dtype"), torch.float32)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(seed)
    written: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        t = state[name]
        if not is_linear(name):
            written[name] = t
            continue
        tensors, deq = quantize_layer(t.float(), fmt, group, gen)
        m = name[: -len(".weight")]
        if dequantized:
            written[name] = deq.to(dtype).contiguous()
        else:
            written.update({f"{m}.{k}": v.contiguous() for k, v in tensors.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    if not dequantized:
        cfg["quantization_config"] = quant_config(fmt, group)
        cfg["torch_dtype"] = "bfloat16" if dtype == torch.bfloat16 else cfg.get("torch_dtype", "float16")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--group-size", type=int, default=32, help="awq / gptq / w4a16: input columns per scale")
    ap.add_argument("--dequantized", action="store_true", help="write the 16-bit weights the quantized ones stand for")
    ap.add_argument("--seed", type=int, default=0, help="gptq-act-order: the column order drawn")
    a = ap.parse_args(argv)
    out = convert(Path(a.src), Path(a.out), a.format, a.group_size, a.dequantized, a.seed)
    print(out)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
