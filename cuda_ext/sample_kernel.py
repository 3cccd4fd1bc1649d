"""The sampler's draw in two Triton kernels: logit bias, temperature, inverse-CDF and greedy rows.

``swiftlm.sampler`` draws a row's token as the first index whose cumulative probability reaches
``u * total`` (``u`` from the row's counter-based generator).  In torch that is ~9 kernels per step
(a float copy, the bias scatter, the division, a softmax and an argmax that run one thread block per row,
a scan, a binary search ...), a noticeable share of a one-stream decode step of a small model, on the
device's critical path (the next step's input ids are these).  Here:

- ``_chunk_kernel``, grid (rows, chunks of ``CHUNK`` tokens): per chunk of the row,
  ``y = (logit + bias) / temperature`` (IEEE division, as torch divides), its max ``m_c``, the first
  index of that max, and ``s_c = sum(exp(y - m_c))``.
- ``_pick_kernel``, grid (rows,): the row's max ``M`` over the chunks, the chunk masses
  ``T_c = s_c * exp(m_c - M)`` and their running sum, ``target = u * sum(T)``, the first chunk whose running
  sum reaches the target, then inside it the first token whose running sum (the chunks before it plus the
  scan of ``exp(y - M)`` over the chunk) reaches the target.  Rounding can leave the scan of that chunk a hair
  short of the target: then its last token of positive weight is taken.  Greedy rows (temperature 1) take
  the first index of the row's max.

The result is the inverse-CDF draw up to float32 rounding (the same token as torch's except where ``u``
falls within rounding of a CDF boundary), deterministic, and always a token of positive probability.  The
sampler's two torch paths both go through it on CUDA (``TorchOps.draw_rows`` after the general path's
filters, ``TorchOps.sample_simple`` for temperature / bias / greedy rows), so a row draws the same token
whichever path its batch takes.  ``draw_ref`` is a float64 torch reference of the same rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # tokens per program of the first kernel


@triton.jit
def _scaled(x_ptr, sx, row, r, idx, m, K: tl.constexpr):
    """Row ``r``'s logits at ``idx`` as float32, plus the row's logit bias (y[col] + val, as the sampler's scatter of
    gather + val), divided by its temperature (IEEE division); -inf outside the vocabulary (``m`` False)."""
    y = tl.load(x_ptr + r.to(tl.int64) * sx + idx, mask=m, other=float("-inf")).to(tl.float32)
    for k in tl.static_range(K):
        col = tl.load(row + 3 + k).to(tl.int32)
        val = tl.load(row + 3 + K + k)
        y = tl.where(idx == col, y + val, y)
    y = tl.math.div_rn(y, tl.zeros_like(y) + tl.load(row))
    return tl.where(m, y, float("-inf"))


@triton.jit
def _chunk_kernel(x_ptr, sx, inp_ptr, si, part_ptr, V, NC, K: tl.constexpr, CH: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * CH + tl.arange(0, CH)
    m = idx < V
    y = _scaled(x_ptr, sx, inp_ptr + r * si, r, idx, m, K)
    mc = tl.max(y, axis=0)
    first = tl.min(tl.where(y == mc, idx, 2147483647), axis=0)
    w = tl.where(y > float("-inf"), tl.exp(y - mc), 0.0)  # a chunk masked whole (top-k ...) weighs 0, not NaN
    s = tl.sum(w, axis=0)
    out = part_ptr + (r * NC + c) * 3
    tl.store(out, mc)
    tl.store(out + 1, s)
    tl.store(out + 2, first.to(tl.float32))


@triton.jit
def _pick_kernel(x_ptr, sx, inp_ptr, si, part_ptr, tok_ptr, V, NC, K: tl.constexpr, CH: tl.constexpr, CP: tl.constexpr):
    r = tl.program_id(0)
    row = inp_ptr + r * si
    cc = tl.arange(0, CP)
    cm = cc < NC
    parts = part_ptr + (r * NC + cc) * 3
    mc = tl.load(parts, mask=cm, other=float("-inf"))
    sc = tl.load(parts + 1, mask=cm, other=0.0)
    fc = tl.load(parts + 2, mask=cm, other=0.0)
    M = tl.max(mc, axis=0)
    argmax = tl.min(tl.where(mc == M, fc, 3.0e38), axis=0).to(tl.int64)  # the first chunk holding the max
    T = tl.where(cm & (sc > 0), sc * tl.exp(mc - M), 0.0)
    cum = tl.cumsum(T, axis=0)
    total = tl.sum(tl.where(cc == NC - 1, cum, 0.0), axis=0)
    u = tl.load(row + 1)
    target = u * total
    cstar = tl.min(tl.where(cm & (cum >= target), cc, NC - 1), axis=0)
    before = tl.sum(tl.where(cc == cstar, cum - T, 0.0), axis=0)
    # the chosen chunk again: y as the first kernel made it, weights relative to the row's max
    idx = cstar * CH + tl.arange(0, CH)
    m = idx < V
    y = _scaled(x_ptr, sx, row, r, idx, m, K)
    w = tl.where(m, tl.exp(y - M), 0.0)
    cs = tl.cumsum(w, axis=0) + before
    hit = tl.min(tl.where(m & (cs >= target) & (w > 0), idx, 2147483647), axis=0)
    last = tl.max(tl.where(m & (w > 0), idx, -1), axis=0)
    tok = tl.where(hit < 2147483647, hit, tl.where(last >= 0, last, argmax)).to(tl.int64)
    greedy = tl.load(row + 2) > 0.5
    out = tl.where(greedy, argmax, tok)
    tl.store(tok_ptr + r, tl.minimum(tl.maximum(out, 0), V - 1))  # a row of NaN logits still names a token


def draw(logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids [n] (int64) for ``logits`` [n, V] (any float dtype, rows contiguous) and the sampler's
    per-row ``inputs`` [n, 3 + 2K] float32 (``swiftlm.sampler.simple_inputs``: temperature, u, greedy,
    K bias ids, K bias values; K may be 0)."""
    n, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    inputs = inputs.contiguous()
    K = (inputs.shape[1] - 3) // 2
    NC = triton.cdiv(V, CHUNK)
    parts = torch.empty((n, NC, 3), dtype=torch.float32, device=logits.device)
    tok = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return tok
    _chunk_kernel[(n, NC)](logits, logits.stride(0), inputs, inputs.stride(0), parts, V, NC, K=K, CH=CHUNK, num_warps=8)
    _pick_kernel[(n,)](
        logits,
        logits.stride(0),
        inputs,
        inputs.stride(0),
        parts,
        tok,
        V,
        NC,
        K=K,
        CH=CHUNK,
        CP=max(2, triton.next_power_of_2(NC)),
        num_warps=8,
    )
    return tok


def draw_ref(logits: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The same rule in float64 torch (for tests): bias, temperature, first index whose cumulative
    probability reaches ``u`` times the total; greedy rows the first index of the max."""
    x, inputs = logits.detach().double().cpu().clone(), inputs.detach().cpu()
    K = (inputs.shape[1] - 3) // 2
    out = []
    for i in range(x.shape[0]):
        row = x[i]
        for k in range(K):
            c, v = int(inputs[i, 3 + k]), float(inputs[i, 3 + K + k])
            row[c] = row[c] + v
        if float(inputs[i, 2]) > 0.5:
            out.append(int(torch.argmax(row)))
            continue
        y = row / float(inputs[i, 0])
        w = torch.exp(y - y.max())
        cdf = torch.cumsum(w, 0)
        t = float(inputs[i, 1]) * float(cdf[-1])
        out.append(int(torch.searchsorted(cdf, torch.tensor([t], dtype=torch.float64))[0]))
    return torch.tensor(out, dtype=torch.int64)
