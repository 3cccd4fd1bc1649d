"""Attention over a compressed cache's codes in plain torch (every device; CPU decode rows go through
``cpu_kernels`` where numba is there): the scores of a block of rows from the codes, values summed from the
probabilities without decoding them (``CompressedCache._attend`` merges the blocks with its 16-bit rows)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from swiftlm.turboquant.presets import KVFormat

from .code_pages import CodeLayer

DECODE_ROWS = 2048  # compressed rows decoded at a time by the plain-torch attention (per KV head)
SCORE_BUDGET = 1 << 21  # fp32 scores [KVH, queries, rows] held at a time: rows per chunk = this / (KVH * queries)


def code_blocks(fmt: KVFormat, kc: Any, vc: Any, L: CodeLayer, qg: torch.Tensor, scale: float) -> Iterator[tuple]:
    """Score/value chunks over the compressed rows (qg: [KVH, M, D] fp32 queries).

    A chunk holds as many rows as SCORE_BUDGET allows (a decode step: the whole history in one
    chunk); its scores are computed DECODE_ROWS rows at a time, each block's codes decoded into a
    reused buffer by one table gather (``TurboCodec.unit_rows``) and multiplied with all queries
    at once.  Its values are never returned decoded: the chunk yields a function that, given the
    chunk's probabilities, sums the values block by block in the same way (TurboQuant: in the
    rotated domain, norms folded into the probabilities; affine: codes times probabilities scaled
    per group, plus the biases weighted by the probabilities)."""
    n = L.n_code
    if not n:
        return
    KVH, M, D = qg.shape
    chunk = max(64, SCORE_BUDGET // (KVH * M))
    blk = min(chunk, DECODE_ROWS)
    turbo = fmt.kind == "turbo"
    if turbo:
        q_rot = qg @ kc.R.T  # rotate the query once per step
        sq = qg @ kc.S_rows.T if kc.qjl else None
    else:
        groups = kc.d // kc.group
        qs = qg.view(KVH, M, groups, -1).sum(-1)  # Σ q per group: what each key's bias adds
        if kc.order is not None:  # the order of ``code_rows``
            qg = qg[..., kc.order.to(qg.device)]
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        sc = torch.empty((KVH, M, e - s), dtype=torch.float32, device=qg.device)
        for b in range(s, e, blk):
            be = min(e, b + blk)
            out = sc[:, :, b - s : be - s]
            if turbo:
                out.copy_(torch.bmm(q_rot, kc.unit_rows(L.kp, b, be).transpose(1, 2)))
                if sq is not None:
                    qjl = torch.bmm(sq, kc.sign_rows(L.ks, b, be).transpose(1, 2))
                    out.addcmul_(qjl, L.kr[:, b:be].float().unsqueeze(1), value=kc.qjl_scale)
            else:
                _affine_scores(kc, L, qg, qs, b, be, out)
        if turbo:
            sc.mul_((L.kn[:, s:e].float() * scale).unsqueeze(1))
        else:
            sc.mul_(scale)
        yield sc, _value_sum(fmt, vc, L, s, e, blk), None, 1 if turbo else 0


def _affine_scores(
    kc: Any, L: CodeLayer, qg: torch.Tensor, qs: torch.Tensor, b: int, be: int, out: torch.Tensor
) -> None:
    """q . (code * scale + bias) per group = scale * (q . code) + bias * Σ q, for rows [b, be)."""
    codes = kc.code_rows(L.kp, b, be)  # [KVH, n, D] fp32 integer codes
    gs = kc.group
    for g in range(kc.d // gs):
        part = torch.bmm(qg[..., g * gs : (g + 1) * gs], codes[..., g * gs : (g + 1) * gs].transpose(1, 2))
        part.mul_(L.kn[:, b:be, g].float().unsqueeze(1))
        part.add_(qs[:, :, g : g + 1] * L.ks[:, b:be, g].float().unsqueeze(1))
        if g:
            out.add_(part)
        else:
            out.copy_(part)


def _value_sum(
    fmt: KVFormat, vc: Any, L: CodeLayer, s: int, e: int, blk: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Σ_j p_j v_j over compressed rows [s, e) for probabilities p [KVH, M, e - s]."""

    def turbo(p: torch.Tensor) -> torch.Tensor:
        p = p * L.vn[:, s:e].float().unsqueeze(1)  # norms into the weights: values stay unit centroids
        acc = None
        for b in range(s, e, blk):
            be = min(e, b + blk)
            vu = vc.unit_rows(L.vp, b, be)
            pb = p[:, :, b - s : be - s]
            acc = torch.bmm(pb, vu) if acc is None else acc.baddbmm_(pb, vu)
        return acc

    def affine(p: torch.Tensor) -> torch.Tensor:
        gs, groups = vc.group, vc.d // vc.group
        acc = None
        for b in range(s, e, blk):
            be = min(e, b + blk)
            codes = vc.code_rows(L.vp, b, be)
            pb = p[:, :, b - s : be - s]
            scale, bias = L.vn[:, b:be].float(), L.vb[:, b:be].float()  # [KVH, n, groups]
            parts = [torch.bmm(pb * scale[:, None, :, g], codes[..., g * gs : (g + 1) * gs]) for g in range(groups)]
            part = torch.cat(parts, -1) if groups > 1 else parts[0]
            base = torch.bmm(pb, bias)  # [KVH, M, groups]
            part = (part.view(*part.shape[:2], groups, gs) + base.unsqueeze(-1)).view(part.shape)
            acc = part if acc is None else acc.add_(part)
        return acc if vc.inverse is None else acc[..., vc.inverse.to(acc.device)]

    return turbo if fmt.kind == "turbo" else affine
