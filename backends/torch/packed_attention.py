"""Causal attention over several prompts packed into one row block, each starting at position 0.

On CUDA in half precision this is FlashAttention-2's variable-length kernel (PyTorch's bundled
``aten._flash_attention_forward`` with cumulative sequence lengths): one kernel per layer, each
prompt causal within itself, grouped-query heads read in place.  Elsewhere (the CPU, fp32, head
sizes the kernel lacks) SDPA with the block-diagonal causal mask.  The mask path is not used on
CUDA where the kernel applies: SDPA has no fused kernel for an arbitrary mask with grouped heads,
so it runs the unfused math ([H, T, T] scores), which costs a long chunk several times its matmuls.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_ok(q: torch.Tensor) -> bool:
    """Can the variable-length flash kernel take these queries ([T, H, D])?
    ``SWIFTLM_VARLEN_ATTENTION=0`` keeps the masked SDPA (A/B runs)."""
    return (
        q.is_cuda
        and q.dtype in _FLASH_DTYPES
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and hasattr(torch.ops.aten, "_flash_attention_forward")
        and os.environ.get("SWIFTLM_VARLEN_ATTENTION", "1") != "0"
    )


def pack(prompts: list[list[int]], slots: list[int]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Prompts (each starting at position 0, each in its pool slot) packed in order into one row block:
    (tokens, each token's slot, its position, its prompt's index, each prompt's last row)."""
    toks: list[int] = []
    sl: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    last: list[int] = []
    for n, (p, s) in enumerate(zip(prompts, slots)):
        toks += p
        sl += [s] * len(p)
        pos += range(len(p))
        seg += [n] * len(p)
        last.append(len(toks) - 1)
    return toks, sl, pos, seg, last


def cu_seqlens(lengths: list[int], total: int | None = None, entries: int | None = None) -> torch.Tensor:
    """int32 [0, l1, l1+l2, ...]; ``total``: one more sequence up to it (padding); ``entries``: repeat the
    last value up to this many entries (zero-length sequences, for a fixed-shape graph input)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if total is not None and total > cu[-1]:
        cu.append(total)
    if entries is not None:
        cu += [cu[-1]] * (entries - len(cu))
    return torch.tensor(cu, dtype=torch.int32)


def packed_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: torch.Tensor,
    pos: torch.Tensor,
    cu: torch.Tensor | None = None,
    max_len: int = 0,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] of prompts packed in order (``seg``: each row's prompt,
    ``pos``: its position in it; ``cu``: the int32 cumulative lengths on q's device, ``max_len``
    the longest).  Returns [T, H, D]."""
    T, H, D = q.shape
    KVH = k.shape[1]
    if cu is not None and varlen_ok(q):
        out = torch.ops.aten._flash_attention_forward(
            q, k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, 0.0, True, False, scale=D**-0.5
        )[0]
        return out
    mask = (seg.view(T, 1) == seg.view(1, T)) & (pos.view(1, T) <= pos.view(T, 1))  # [T(query), T(key)]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=H != KVH,
    )
    return out[0].transpose(0, 1)


def prefill_attention(device: torch.device, T: int) -> Any:
    """SDPA without its cuDNN backend for prompt chunks on CUDA.  cuDNN (torch's first choice for
    bf16 on Hopper) builds and NVRTC-compiles a kernel for every new query/key length: with prompts
    of varied lengths that is a large share of the engine thread's time and long stalls in the
    inter-token latency.  Decode keeps it: its shapes are fixed per captured graph, and there cuDNN's
    kernel is the fastest."""
    if device.type != "cuda" or T <= 1:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
