"""Batched decode attention over a paged (or slotted) KV cache, read in place, with split-K.

One query row per sequence (the token being decoded, whose K/V are already in the cache)
attends to that sequence's first ``seq_lens[b]`` positions, found through its block table::

    position p of sequence b  ->  k_cache[block_tables[b, p // block_size], kv_head, p % block_size, :]

The cache is ``[num_blocks, KVH, block_size, D]`` with any strides, so both layouts work:

- a paged pool (block_size 16..128, blocks anywhere in the pool, in any order), and
- the slot pool of ``backends/torch/graphs.py`` (``[S + 1, KVH, capacity, D]``): one block per
  sequence, ``block_size = capacity``, ``block_tables = slots[:, None]``.

Kernel 1 (``_split_kernel``), grid ``(B, KVH, num_splits)``: a program owns one KV head of one
sequence and a contiguous range of its positions (the sequence's length divided into
``num_splits`` ranges, computed on the device, whole tiles of ``BLOCK_N`` positions each; a
range past a short sequence's end is empty and contributes nothing).  It loads each K/V tile
once for all ``rep = H // KVH`` query heads of that KV head: with ``tl.dot`` on the query group
padded to 16 rows (tensor cores; the default), or with a broadcast multiply + sum
(``use_dot=False``).  The dot is the faster form: the broadcast form holds a [rep, BLOCK_N, D] fp32
product in registers, which forces BLOCK_N=16 and leaves it far below the memory bandwidth, and even
for rep 1, where 15 of the 16 MMA rows are padding, the dot wins - the tensor cores have compute to
spare at decode's arithmetic intensity, the CUDA cores do not (``scripts/bench_paged_attention.py``
times both).
Scores and the output are accumulated in fp32 with an online softmax (running max and sum, in
the exp2 domain).  Kernel 2 (``_combine_kernel``), grid ``(B, H)``, merges the per-split
``(log-sum-exp, normalised output)`` pairs; with one split kernel 1 writes ``out`` directly.

Nothing reads a device value on the host, all shapes depend on (B, max_blocks, num_splits)
only, so a call can be captured in a CUDA graph and replayed with new tables and lengths.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import launch_kw

_LOG2E = 1.4426950408889634


def _interpret() -> bool:
    # Triton's CPU interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits; there the
    # kernel feeds the dot the same (exactly representable) bf16 values widened to fp32.
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------- kernels
@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    len_ptr,
    out_ptr,
    mid_o,
    mid_lse,
    ks_ptr,
    vs_ptr,
    qk_scale,
    NS,
    MAX_BLOCKS,
    sq_b,
    sq_h,
    sq_d,
    sk_n,
    sk_h,
    sk_p,
    sk_d,
    sv_n,
    sv_h,
    sv_p,
    sv_d,
    sbt_b,
    sbt_i,
    so_b,
    so_h,
    so_d,
    REP: tl.constexpr,
    RP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,
    DIRECT: tl.constexpr,
    GDC: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)  # KV head
    s = tl.program_id(2)  # split
    if GDC:  # programmatic dependent launch (pdl.py): q and this step's K/V row are the previous kernels'
        tl.extra.cuda.gdc_wait()
    H = tl.num_programs(1) * REP
    n_pos = tl.load(len_ptr + b)
    n_pos = tl.minimum(tl.maximum(n_pos, 0), MAX_BLOCKS * BS)  # never read past the table
    chunk = tl.cdiv(tl.cdiv(n_pos, NS), BLOCK_N) * BLOCK_N  # whole tiles: tile starts stay aligned
    start = s * chunk
    end = tl.minimum(start + chunk, n_pos)

    r = tl.arange(0, RP)
    d = tl.arange(0, DP)
    rm = r < REP
    dm = d < D
    h = g * REP + r
    q = tl.load(
        q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :] * sq_d, mask=rm[:, None] & dm[None, :], other=0.0
    )  # [RP, DP]
    v_sc = 1.0
    if KV_FP8:  # e4m3 tiles: widened to float16; the head's K scale folds into the score scale, V's into o
        qk_scale = qk_scale * tl.load(ks_ptr + g)
        v_sc = tl.load(vs_ptr + g)
    if IEEE or not USE_DOT:
        q = q.to(tl.float32)
    elif KV_FP8:  # float16 dots: e4m3 -> f16 is one instruction per pair (-> bf16 goes through f32)
        q = q.to(tl.float16)
    else:  # tensor-core dot in the cache's 16-bit type, fp32 accumulation
        q = q.to(k_ptr.dtype.element_ty)
    m = tl.full((RP,), float("-inf"), tl.float32)
    l = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((RP, DP), tl.float32)
    bt = bt_ptr + b.to(tl.int64) * sbt_b
    k_head = k_ptr + g.to(tl.int64) * sk_h
    v_head = v_ptr + g.to(tl.int64) * sv_h
    for t in range(start, end, BLOCK_N):
        n = t + tl.arange(0, BLOCK_N)
        nm = n < end
        if TILE_IN_BLOCK:  # the tile lies inside one block: one block id
            blk = tl.load(bt + (t // BS) * sbt_i).to(tl.int64)
            off = n % BS
            k_rows = k_head + blk * sk_n + off * sk_p
            v_rows = v_head + blk * sv_n + off * sv_p
        else:  # the tile spans blocks: a block id per position
            blk = tl.load(bt + (n // BS) * sbt_i, mask=nm, other=0).to(tl.int64)
            off = n % BS
            k_rows = k_head + blk * sk_n + off * sk_p
            v_rows = v_head + blk * sv_n + off * sv_p
        kv_mask = nm[:, None] & dm[None, :]
        k = tl.load(k_rows[:, None] + d[None, :] * sk_d, mask=kv_mask, other=0.0)  # [BLOCK_N, DP]
        if KV_FP8:
            k = k.to(tl.float16)
        if USE_DOT:
            if IEEE:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif DOT_F32:
                qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
            else:
                qk = tl.dot(q, tl.trans(k))
        else:
            qk = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [RP, BLOCK_N]
        qk = tl.where(nm[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))  # finite: every tile holds >= 1 position
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_rows[:, None] + d[None, :] * sv_d, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(tl.float16)
        if USE_DOT:
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif DOT_F32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
            else:
                pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [RP, DP]
        acc = acc * alpha[:, None] + pv
        m = m_new
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    o = acc * v_sc / tl.where(l > 0, l, 1.0)[:, None]  # an empty range (or seq_len 0): zeros, not NaN
    if DIRECT:
        tl.store(
            out_ptr + b * so_b + h[:, None] * so_h + d[None, :] * so_d,
            o.to(out_ptr.dtype.element_ty),
            mask=rm[:, None] & dm[None, :],
        )
    else:
        row = (b * H + h) * NS + s  # [RP] rows of mid_lse / mid_o
        tl.store(mid_lse + row, tl.where(l > 0, m + tl.math.log2(tl.where(l > 0, l, 1.0)), float("-inf")), mask=rm)
        tl.store(mid_o + row[:, None] * D + d[None, :], o, mask=rm[:, None] & dm[None, :])


@triton.jit
def _combine_kernel(
    mid_o,
    mid_lse,
    out_ptr,
    NS,
    so_b,
    so_h,
    so_d,
    D: tl.constexpr,
    DP: tl.constexpr,
    NSP: tl.constexpr,
    GDC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    H = tl.num_programs(1)
    i = tl.arange(0, NSP)
    im = i < NS
    d = tl.arange(0, DP)
    dm = d < D
    base = (b * H + h) * NS
    lse = tl.load(mid_lse + base + i, mask=im, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # no positions at all: weights 0
    w = tl.math.exp2(lse - mx)
    den = tl.sum(w, axis=0)
    o = tl.load(mid_o + (base + i)[:, None] * D + d[None, :], mask=im[:, None] & dm[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * so_b + h * so_h + d * so_d, res.to(out_ptr.dtype.element_ty), mask=dm)


# ------------------------------------------------------------------------------- host side
def default_splits(
    max_len: int,
    batch: int,
    kv_heads: int,
    sm_count: int = 132,
    *,
    min_chunk: int = 64,
    waves: int = 4,
    max_splits: int = 32,
) -> int:
    """How many splits per (sequence, KV head) for sequences of up to ``max_len`` positions.

    Aim for about ``waves * sm_count`` programs (rounding down: at 4 x 132 = 528 an H100 is full;
    several of these small programs are resident per SM, which is what keeps enough loads in
    flight), never cut a sequence into ranges shorter than ``min_chunk`` positions, and use one
    split (no partials, no combine launch) once the batch alone fills the GPU.  A power of two, so
    few values occur (few graph / compile variants).  Calibrated with the Llama-3-8B shape
    (scripts/bench_paged_attention.py sweeps 1..64 splits under CUDA-graph replay): the pick is the
    fastest or close to it for B in 1..128 x context 256..32768."""
    progs = max(1, batch * kv_heads)
    want = max(1, waves * sm_count // progs)
    cap = max(1, -(-max(1, max_len) // min_chunk))
    n = max(1, min(want, cap, max_splits))
    return 1 << (n.bit_length() - 1)  # round down to a power of two


def _config(rep: int, DP: int, use_dot: bool | None, block_n: int | None) -> tuple[bool, int, int]:
    if use_dot is None:
        use_dot = True  # tensor cores: faster for every rep, rep 1 included (see the module docstring)
    RP = max(16, triton.next_power_of_2(rep)) if use_dot else triton.next_power_of_2(rep)
    if block_n is None:
        if use_dot:
            block_n = 64 if DP <= 128 else 32
        else:  # the [RP, BLOCK_N, DP] fp32 product lives in registers
            block_n = max(16, min(64, triton.next_power_of_2(8192 // (RP * DP)) if RP * DP <= 8192 else 16))
    return use_dot, RP, block_n


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` [B, H, D] over each sequence's cached K/V; returns ``out`` [B, H, D]
    (allocated in q's dtype unless given; any strides).

    An FP8 cache (``--kv-cache-dtype fp8``: k_cache / v_cache float8 e4m3) takes ``k_scale`` / ``v_scale``,
    float32 [KVH] device tensors: position p of KV head g holds ``k_cache[...] * k_scale[g]``.  The kernel
    widens each e4m3 tile to float16 (one conversion instruction per pair on the GPU; to bfloat16 it would go
    through float32, which made the kernel compute-bound at half the 16-bit kernel's bandwidth:
    scripts/bench_fp8_kv_kernel.py), runs its dots in float16 with float32 accumulation (q rounded to float16: a
    finer mantissa than bfloat16's, enough range for query values), and folds the scales into the score scale and
    the output.

    k_cache, v_cache: [num_blocks, KVH, block_size, D] (any strides; same shape).  block_tables:
    int32 [B, max_blocks], the block ids of each sequence in position order (entries past a
    sequence's length are never read).  seq_lens: int32 [B], positions to attend including the
    current one; 0 gives a zero row.  Query head h uses KV head h // (H // KVH).  ``scale``:
    multiplies q.k (usually D ** -0.5).

    ``num_splits``: ranges each sequence is cut into (fixed per captured graph: pass it
    explicitly, e.g. ``default_splits(max_blocks * block_size, B, KVH)``; None picks that
    default from the table's capacity).  ``block_n`` / ``num_warps`` / ``num_stages`` /
    ``use_dot``: tuning knobs (see ``scripts/bench_paged_attention.py``)."""
    B, H, D = q.shape
    NB, KVH, BS, Dk = k_cache.shape
    assert v_cache.shape == k_cache.shape and Dk == D, (q.shape, k_cache.shape, v_cache.shape)
    assert H % KVH == 0, f"{H} query heads over {KVH} KV heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B and seq_lens.shape == (B,)
    assert block_tables.dtype in (torch.int32, torch.int64) and seq_lens.dtype in (torch.int32, torch.int64)
    rep = H // KVH
    max_blocks = block_tables.shape[1]
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    assert out.shape == (B, H, D)
    if B == 0:
        return out
    if num_splits is None:
        num_splits = default_splits(max_blocks * BS, B, KVH)
    NS = max(1, int(num_splits))
    DP = triton.next_power_of_2(D)
    dot, RP, BN = _config(rep, DP, use_dot, block_n)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        assert k_scale is not None and v_scale is not None, "an e4m3 cache needs k_scale and v_scale"
        assert k_scale.shape == (KVH,) and v_scale.shape == (KVH,), (k_scale.shape, v_scale.shape)
    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    direct = NS == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((B, H, NS, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, H, NS), dtype=torch.float32, device=q.device)
    kw = {}
    if num_warps is not None:
        kw["num_warps"] = num_warps
    if num_stages is not None:
        kw["num_stages"] = num_stages
    _split_kernel[(B, KVH, NS)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        mid_o,
        mid_lse,
        k_scale if fp8 else seq_lens,  # (unread without KV_FP8)
        v_scale if fp8 else seq_lens,
        float(scale) * _LOG2E,
        NS,
        max_blocks,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        block_tables.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        REP=rep,
        RP=RP,
        D=D,
        DP=DP,
        BS=BS,
        BLOCK_N=BN,
        TILE_IN_BLOCK=BS % BN == 0,
        USE_DOT=dot,
        IEEE=ieee,
        DOT_F32=_interpret() and torch.bfloat16 in (k_cache.dtype, q.dtype),
        DIRECT=direct,
        KV_FP8=fp8,
        **kw,
        **launch_kw(q),
    )
    if not direct:
        _combine_kernel[(B, H)](
            mid_o,
            mid_lse,
            out,
            NS,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            D=D,
            DP=DP,
            NSP=triton.next_power_of_2(NS),
            **launch_kw(q),
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    **_tuning,
) -> torch.Tensor:
    """Plain torch, one sequence at a time (host syncs; not capturable): gather the sequence's
    blocks (an e4m3 cache dequantised: fp32 rows * their head's scale), softmax in fp32.  Same contract
    as ``paged_decode_attention`` (num_splits ignored)."""
    B, H, D = q.shape
    _, KVH, BS, _ = k_cache.shape
    rep = H // KVH
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()
    for b in range(B):
        L = max(0, min(int(lens[b]), block_tables.shape[1] * BS))
        if L == 0:
            out[b] = 0
            continue
        blocks = block_tables[b, : -(-L // BS)].long()
        k = k_cache[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :L].float()  # [KVH, L, D]
        v = v_cache[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :L].float()
        if k_scale is not None:
            k, v = k * k_scale.float().view(KVH, 1, 1), v * v_scale.float().view(KVH, 1, 1)
        qb = q[b].float().view(KVH, rep, D)
        p = torch.softmax(torch.einsum("grd,gnd->grn", qb, k) * scale, dim=-1)
        out[b] = torch.einsum("grn,gnd->grd", p, v).reshape(H, D).to(out.dtype)
    return out


def paged_decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    **_tuning,
) -> torch.Tensor:
    """Plain torch without host syncs (a CUDA-graph-capturable fallback when Triton is off):
    gathers every sequence's ``max_blocks`` blocks (dequantised, for an e4m3 cache) and runs masked SDPA.
    Same contract."""
    B, H, D = q.shape
    _, KVH, BS, _ = k_cache.shape
    MB = block_tables.shape[1]
    idx = block_tables.long()
    k = k_cache[idx].permute(0, 2, 1, 3, 4).reshape(B, KVH, MB * BS, D)
    v = v_cache[idx].permute(0, 2, 1, 3, 4).reshape(B, KVH, MB * BS, D)
    if k_scale is not None:
        k = (k.float() * k_scale.float().view(1, KVH, 1, 1)).to(q.dtype)
        v = (v.float() * v_scale.float().view(1, KVH, 1, 1)).to(q.dtype)
    pos = torch.arange(MB * BS, device=q.device)
    lens = seq_lens.long().view(B, 1)
    mask = (pos.view(1, -1) < lens) | (pos.view(1, -1) == 0)  # a zero-length row attends to slot 0 ...
    res = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask.view(B, 1, 1, -1), scale=scale, enable_gqa=H != KVH
    ).squeeze(2)
    res = torch.where((lens > 0).view(B, 1, 1), res, torch.zeros((), dtype=res.dtype, device=res.device))  # ... then 0
    if out is None:
        return res
    out.copy_(res)
    return out


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write each sequence's new k, v [B, KVH, D] at its position (``positions`` [B], int): block
    ``block_tables[b, pos // block_size]``, row ``pos % block_size``.  Device indexing only (no
    host sync: capturable).  Padding rows must point at a scratch block."""
    BS = k_cache.shape[2]
    pos = positions.long()
    blk = block_tables.long().gather(1, (pos // BS).view(-1, 1)).view(-1)
    off = pos % BS
    k_cache[blk, :, off] = k.to(k_cache.dtype)
    v_cache[blk, :, off] = v.to(v_cache.dtype)


def selfcheck(device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> float:
    """Relative error kernel vs reference on one small random mixed batch (for ``enabled()``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, KVH, rep, D, BS, MB = 4, 2, 4, 64, 16, 6
    NB = B * MB + 3
    kc = torch.randn(NB, KVH, BS, D, generator=g).to(device=device, dtype=dtype)
    vc = torch.randn(NB, KVH, BS, D, generator=g).to(device=device, dtype=dtype)
    bt = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).to(device=device, dtype=torch.int32)
    lens = torch.tensor([1, 37, MB * BS, 0], dtype=torch.int32, device=device)
    q = torch.randn(B, KVH * rep, D, generator=g).to(device=device, dtype=dtype)
    a = paged_decode_attention(q, kc, vc, bt, lens, D**-0.5, num_splits=3)
    r = paged_decode_attention_ref(q, kc, vc, bt, lens, D**-0.5)
    return float((a.float() - r.float()).norm() / (r.float().norm() + 1e-12))


__all__ = [
    "default_splits",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_sdpa",
    "write_kv",
    "selfcheck",
]
