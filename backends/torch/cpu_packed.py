"""fp32 weights pre-packed for oneDNN on the CPU (``rows_linear``'s CPU path).

MKL's sgemm re-packs the whole weight on every call when it multiplies a few rows (a decode step's
[B, hidden] activations), and with the weights streaming from DRAM each step it reaches neither the
memory bound nor the compute bound.  Here the weights are packed once into oneDNN's blocked layout at load
(``torch.ops.mkldnn._reorder_linear_weight``) and multiplied by ``torch.ops.mkldnn._linear_pointwise`` (the op
torch.compile's CPU backend uses for the same job), which skips the per-call packing
(``scripts/bench_cpu_linear.py`` compares the two).  Used for up to 64 rows (decode steps, short chunks):
longer prefill chunks, though faster packed too, stay on MKL, because oneDNN keeps a primitive per row count
and prompts of every length would grow the process's memory with each new length.  The packed
copy is a second copy of those weights (the originals stay: embeddings, LoRA, export and the other paths read
them), so it is made only when it fits in a quarter of the memory available at load; ``SWIFTLM_CPU_PACK=0`` turns
it off, ``=1`` forces it.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

ATTR = "_swiftlm_mkldnn"  # the packed weight, attached to the weight tensor it was made from
HINT_ROWS = 64  # the row count oneDNN picks its blocking for (a blocking for 64 rows serves 3-256 rows as well as any)


def packed(w: torch.Tensor) -> torch.Tensor | None:
    return w.__dict__.get(ATTR)


def linear(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The matrices a llama-family step hands to ``rows_linear``: fused QKV, output, fused gate/up,
    down projections and the LM head."""
    out = []
    for layer in getattr(model, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        qkv = getattr(attn, "qkv", None)
        if qkv is not None:
            out.append(qkv[0])
        for lin in (getattr(attn, "o_proj", None), getattr(mlp, "down_proj", None)):
            if type(lin) is nn.Linear:
                out.append(lin.weight)
        if getattr(mlp, "gate_up", None) is not None:
            out.append(mlp.gate_up)
    head = getattr(model, "lm_head", None)
    emb = getattr(model, "embed_tokens", None)
    if type(head) is nn.Linear:
        out.append(head.weight)
    elif head is None and emb is not None:
        out.append(emb.weight)
    return [
        w for w in out if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous()
    ]


def pack(model: nn.Module) -> int:
    """Attach a oneDNN-packed copy to each fp32 CPU matrix of ``model``'s steps; the bytes added (0:
    nothing packed: not wanted, oneDNN absent, too little memory, or its self-check failed)."""
    mode = os.environ.get("SWIFTLM_CPU_PACK", "auto")
    if mode == "0" or not torch.backends.mkldnn.is_available():
        return 0
    ws = _weights(model)
    need = sum(w.numel() * w.element_size() for w in ws)
    if not ws:
        return 0
    avail = _available_bytes()
    if mode != "1" and (avail == 0 or need > avail // 4):
        log.info(
            "CPU weights not packed for oneDNN: %.0f MB would not fit in a quarter of the %.0f MB available "
            "(SWIFTLM_CPU_PACK=1 forces it)",
            need / 2**20,
            avail / 2**20,
        )
        return 0
    with torch.no_grad():
        try:
            w = ws[0]
            p = torch.ops.mkldnn._reorder_linear_weight(w, HINT_ROWS)
            x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
            ref = x @ w.t()
            err = float((linear(x, p, None) - ref).abs().max())
            # fp32 both ways, one dot product of w.shape[1] terms summed in another order
            if not err <= 1e-4 * (float(ref.abs().max()) + 1.0):
                log.warning("oneDNN packed linear disagrees with torch (max error %.3g): not used", err)
                return 0
            for w in ws:
                setattr(w, ATTR, torch.ops.mkldnn._reorder_linear_weight(w, HINT_ROWS))
        except RuntimeError as e:  # pragma: no cover - a torch build without these ops
            log.warning("oneDNN weight packing unavailable (%s): MKL's GEMM is used", e)
            for w in ws:
                w.__dict__.pop(ATTR, None)
            return 0
    log.info("packed %d CPU weight matrices for oneDNN (%.0f MB)", len(ws), need / 2**20)
    return need
