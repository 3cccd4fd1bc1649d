"""The batched decode step of the llama-family layer (``decode_batch``): one token for each of B
sequences in one pass, the matmuls on [B, hidden] rows (weights read once per step), attention per
sequence over its own cache, compressed caches and shared prefixes (shared_kv.ForkedCache) included."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import cpu_batch_attention
from .kv_cache import SeqCache
from .linear_rows import linear, lora_add, out_proj, rows_linear
from .model import MLP, Attention, Transformer
from .offload import from_offload, to_offload
from .rope import apply_rope


def project_qkv(attn: Attention, x: torch.Tensor, mm: Any = linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, H, D], k and v [n, KVH, D] for n rows (fused QKV matmul, then q/k norms if any)."""
    a, n = attn.a, x.shape[0]
    q, k, v = lora_add(attn, x, mm(x, *attn.qkv)).split(attn.splits, dim=-1)
    q, k, v = q.view(n, a.heads, a.head_dim), k.view(n, a.kv_heads, a.head_dim), v.view(n, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _mlp_rows(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(mlp, MLP) or not hasattr(mlp, "gate_up"):
        return mlp(x)
    g, u = lora_add(mlp, x, rows_linear(x, mlp.gate_up)).chunk(2, dim=-1)
    return out_proj(mlp.down_proj, mlp.act(g) * u)


def _row_attention(
    attn: Attention, cache: Any, layer: int, pos: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """One sequence's decode-row attention (q [H, D], k/v [KVH, D]) -> [1, H*D]."""
    a = attn.a
    if not isinstance(cache, SeqCache):
        return cache.update_attend(layer, pos, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
    keys, values = cache.update(layer, pos, k.unsqueeze(1), v.unsqueeze(1))
    if a.window(layer):  # sliding window: the last w keys
        keys, values = keys[:, -a.window(layer) :], values[:, -a.window(layer) :]
    qg = q.reshape(a.kv_heads, a.heads // a.kv_heads, a.head_dim)
    probs = torch.softmax((qg @ keys.transpose(1, 2) * a.head_dim**-0.5).float(), dim=-1).to(values.dtype)
    return (probs @ values).reshape(1, a.heads * a.head_dim)


def _prefix_groups(caches: list[Any]) -> list[tuple[Any, list[int]]]:
    """Rows whose caches share one prefix (shared_kv.ForkedCache): [(prefix, row indices)]."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for b, c in enumerate(caches):
        p = getattr(c, "prefix", None)
        if p is not None:
            groups.setdefault(id(p), (p, []))[1].append(b)
    return list(groups.values())


def _shared_prefix_attention(
    groups: list[tuple[Any, list[int]]], layer: int, q: torch.Tensor, own: torch.Tensor, Vp: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention of rows over (shared prefix | own rows): q [B, KVH, rep, D], ``own`` the masked
    float32 scores over the own rows [B, KVH, rep, L], ``Vp`` their values [B, KVH, L, D].  The queries
    of all the rows of one prefix go against it in one matmul (the prefix is read once); one softmax
    over the concatenated scores.  Rows without a prefix attend over their own rows only."""
    B, KVH, rep, D = q.shape
    out = torch.empty(B, KVH, rep, D, dtype=Vp.dtype, device=Vp.device)
    rest = sorted(set(range(B)) - {b for _, rows in groups for b in rows})
    if rest:
        r = torch.tensor(rest, device=q.device)
        out[r] = torch.matmul(torch.softmax(own[r], dim=-1).to(Vp.dtype), Vp[r])
    for prefix, rows in groups:
        g, r = len(rows), torch.tensor(rows, device=q.device)
        pk, pv = prefix.k[layer], prefix.v[layer]  # [KVH, P, D]
        P = pk.shape[1]
        qg = q[r].permute(1, 0, 2, 3).reshape(KVH, g * rep, D)
        pre = (torch.matmul(qg, pk.transpose(1, 2)) * scale).view(KVH, g, rep, P).permute(1, 0, 2, 3)
        probs = torch.softmax(torch.cat([pre.float(), own[r]], dim=-1), dim=-1).to(Vp.dtype)
        pp = probs[..., :P].permute(1, 0, 2, 3).reshape(KVH, g * rep, P)
        from_prefix = torch.matmul(pp, pv).view(KVH, g, rep, D).permute(1, 0, 2, 3)
        out[r] = from_prefix + torch.matmul(probs[..., P:], Vp[r])
    return out


def decode_batch(
    model: Transformer,
    caches: list[SeqCache],
    tokens: list[int] | None,
    positions: list[int],
    x: torch.Tensor | None = None,
    head: bool = True,
) -> torch.Tensor:
    """One decode token for each of B sequences in one pass: the matmuls (QKV, output,
    MLP / experts, LM head) run on [B, hidden] rows, so the weights are read once per step
    instead of once per sequence; attention runs per sequence over its own cache.
    Returns logits [B, V].  A pipeline stage (pipeline.py) passes the previous stage's
    activations ``x`` instead of ``tokens``, and ``head=False`` for the pre-norm activations."""
    if getattr(model, "decode_rows", None) is not None:  # archs.py's layers (soft caps, post-norms, ...)
        return model.decode_rows(caches, tokens, positions, x=x, head=head)
    a = model.a
    B, H, KVH, D = len(positions), a.heads, a.kv_heads, a.head_dim
    dev = model.cos.device  # a pipeline stage may hold no embedding
    if x is None:
        x = model.embed(
            tokens.long() if torch.is_tensor(tokens) else torch.tensor(tokens, dtype=torch.long, device=dev)
        )
    pos = torch.tensor(positions, dtype=torch.long, device=dev)
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)  # [B, 1, D]
    rep, scale = H // KVH, D**-0.5
    lmax = max(positions) + 1
    pad_mask = torch.arange(lmax, device=dev).view(1, lmax) > pos.view(B, 1)  # True: padding
    plain = all(isinstance(c, SeqCache) for c in caches)
    groups = _prefix_groups(caches) if plain and not a.windows and a.offload is None else []
    if groups:  # forked caches (shared_kv.py): the own segments start at their prefix's end
        base = torch.tensor(
            [getattr(c, "base", 0) if getattr(c, "prefix", None) is not None else 0 for c in caches],
            dtype=torch.long,
            device=dev,
        )
        lmax = int((pos - base).max()) + 1
        pad_mask = torch.arange(lmax, device=dev).view(1, lmax) > (pos - base).view(B, 1)
    # CPU, plain fp32 caches: each layer's attention for all rows in one numba call (cpu_batch_attention.py)
    fast = (
        cpu_batch_attention.StepAddresses(caches, positions)
        if plain and not groups and cpu_batch_attention.usable(model, caches, SeqCache)
        else None
    )
    for i, blk in enumerate(model.layers):
        if a.offload is not None and i == a.offload[0]:
            x, cos, sin, pad_mask = to_offload(a, x, cos, sin, pad_mask)
        attn = blk.self_attn
        q, k, v = project_qkv(attn, blk.input_layernorm(x), rows_linear)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if fast is not None:
            x = x + out_proj(attn.o_proj, cpu_batch_attention.attend(fast, i, q, k, v, scale))
            x = x + _mlp_rows(blk.mlp, blk.post_attention_layernorm(x))
            continue
        if not plain:  # compressed caches (possibly mixed with plain ones): attention per row
            out = torch.cat([_row_attention(attn, caches[b], i, positions[b], q[b], k[b], v[b]) for b in range(B)])
            x = x + out_proj(attn.o_proj, out)
            x = x + _mlp_rows(blk.mlp, blk.post_attention_layernorm(x))
            continue
        ks, vs = [], []
        w = a.window(i)
        for b in range(B):
            up = caches[b].update_own if groups and getattr(caches[b], "prefix", None) is not None else caches[b].update
            keys, values = up(i, positions[b], k[b].unsqueeze(1), v[b].unsqueeze(1))
            if w:  # sliding window: the last w keys (a window layer may hold fewer rows than pos + 1)
                keys, values = keys[:, -w:], values[:, -w:]
            ks.append(keys.transpose(0, 1))  # [len_b, KVH, D]
            vs.append(values.transpose(0, 1))
        # padded batched attention: one matmul pair for all rows; padding is masked to -inf,
        # so each row's softmax and weighted sum are those of its own length
        K = torch.nn.utils.rnn.pad_sequence(ks, batch_first=True).permute(0, 2, 3, 1)  # [B, KVH, D, Lmax]
        Vp = torch.nn.utils.rnn.pad_sequence(vs, batch_first=True).transpose(1, 2)  # [B, KVH, Lmax, D]
        scores = torch.matmul(q.view(B, KVH, rep, D), K) * scale  # [B, KVH, rep, Lmax]
        hide = pad_mask
        if w:  # each row's own window rows: padding past min(pos + 1, w)
            n = torch.tensor([t.shape[0] for t in ks], dtype=torch.long, device=scores.device)
            hide = torch.arange(K.shape[-1], device=scores.device).view(1, -1) >= n.view(B, 1)
        scores = scores.float().masked_fill(hide.view(B, 1, 1, -1), float("-inf"))
        if groups:
            out = _shared_prefix_attention(groups, i, q.view(B, KVH, rep, D), scores, Vp, scale).reshape(B, H * D)
        else:
            probs = torch.softmax(scores, dim=-1).to(Vp.dtype)
            out = torch.matmul(probs, Vp).reshape(B, H * D)
        x = x + out_proj(attn.o_proj, out)
        x = x + _mlp_rows(blk.mlp, blk.post_attention_layernorm(x))
    if fast is not None:
        fast.finish()
    if not head:
        return x
    if a.offload is not None:
        x = from_offload(x, model.norm.weight)
    x = model.norm(x)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return rows_linear(x, w)
