"""Architectures beyond the llama family, native in the torch backend: Gemma 2, Gemma 3 (text),
Phi-3 / Phi-4, OLMo 2 and SmolLM3.  model.py keeps the llama-family layer; this module adds the
math those five change, on the same weights-by-HF-name, ``SeqCache`` and ``PackedAttend`` (what they
read from a config.json: archs_config.py):

- Gemma 2 / 3: attention-logit and final-logit soft-capping (tanh), ``query_pre_attn_scalar``
  as the attention scale, norms before *and* after attention and MLP ((1 + w) RMSNorm, folded
  at load by build.build), alternating sliding / global layers (``layer_types``); Gemma 3 adds
  q/k norms per head and a rope table per layer type (``rope_local_base_freq`` for sliding
  layers, the rope scaling on global ones).
- Phi-3 / Phi-4: fused ``qkv_proj`` / ``gate_up_proj`` (split at load), ``longrope`` (short /
  long factors; as transformers, a forward whose last position is past
  ``original_max_position_embeddings`` uses the long factors), ``partial_rotary_factor``.
- OLMo 2: norms after attention and MLP only, q/k norms over the whole projection.
- SmolLM3: llama with NoPE layers (``no_rope_layers``: 0 = no rotary embedding).

Attention runs eagerly where a soft cap applies (as transformers' eager path: scale, cap,
mask, fp32 softmax), through SDPA otherwise.  On CUDA these architectures run on the eager path
(``model_config.Args.eager_reason``, runner.TorchModel's ``static`` off): per-sequence caches and eager forwards,
since the CUDA graphs, slot pool prefill and paged attention run the llama-family layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .archs_config import GEMMA, NORMS, Ext
from .attend import CoreCacheAttend, CorePackedAttend, CoreRowsAttend
from .forward import blocks, head_weight, mlp_rows, token_ids
from .kv_cache import SeqCache
from .linear_rows import lora_add, out_proj, rows_linear
from .model import MLP, Attention, PackedAttend, RMSNorm, Transformer, causal_mask
from .rope import apply_rope, rope_tables


def convert_state(a: Any, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` split into q/k/v and gate/up (Attention.fuse and
    MLP.fuse join them again); other names are HF's already."""
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    for k in [k for k in sd if k.endswith("self_attn.qkv_proj.weight")]:
        w = sd.pop(k)
        p = k[: -len("qkv_proj.weight")]
        sd[p + "q_proj.weight"], sd[p + "k_proj.weight"], sd[p + "v_proj.weight"] = w.split([q, kv, kv])
    for k in [k for k in sd if k.endswith("mlp.gate_up_proj.weight")]:
        w = sd.pop(k)
        p = k[: -len("gate_up_proj.weight")]
        sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"] = w.chunk(2)
    return sd


def longrope_tables(a: Any, lr: dict, long: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``_compute_longrope_parameters``: inv_freq / ext_factors, cos/sin times the attention factor."""
    dim, orig, factor = a.ext.rot_dim, lr["original"], lr["factor"]
    att = lr["attention_factor"]
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(lr["long_factor" if long else "short_factor"], dtype=torch.float64)
    inv = 1.0 / (ext * a.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(a.ctx, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * att).float().to(device), (emb.sin() * att).float().to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the first ``cos.shape[-1]`` dimensions (partial rotary), the rest as they are."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def attention(
    e: Ext, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int
) -> torch.Tensor:
    """q [H, T, D] at positions [start, start + T) over keys/values [KVH, start + T, D] -> [T, H*D]:
    causal, the last ``window`` keys only where a window applies, soft-capped logits if set.  A window
    layer's keys may begin later than position 0 (``SeqCache`` drops rows no query sees): the keys are
    always the positions up to ``start + T``, so the masks are built from their count, not ``start``."""
    H, T, D = q.shape
    KVH, S = keys.shape[0], keys.shape[1]
    rep = H // KVH
    if T == 1 and window and S > window:
        keys, values, S = keys[:, -window:], values[:, -window:], window
        mask = None
    elif T == 1:
        mask = None
    else:  # a window layer may have dropped its oldest rows (kv_cache.SeqCache): the chunk starts at row S - T
        mask = causal_mask(T, S, S - T, window, q.device)
    if e.attn_softcap is None and T > 1:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=e.scale, enable_gqa=rep > 1
        )[0]
        return out.transpose(0, 1).reshape(T, H * D)
    # eager, as transformers' eager attention: scores * scale, tanh soft cap, mask, fp32 softmax
    scores = torch.matmul(q.reshape(KVH, rep * T, D), keys.transpose(1, 2)) * e.scale  # [KVH, rep*T, S]
    if e.attn_softcap is not None:
        scores = torch.tanh(scores / e.attn_softcap) * e.attn_softcap
    scores = scores.float()
    if mask is not None:
        scores = scores.view(KVH, rep, T, S).masked_fill(~mask, float("-inf")).view(KVH, rep * T, S)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values).view(H, T, D)
    return out.transpose(0, 1).reshape(T, H * D)


def compressed_refused(a: Any) -> NotImplementedError:
    return NotImplementedError(
        f"a compressed KV cache is not implemented for architecture {a.arch!r}; use the plain KV format for this model"
    )


class ExtAttention(Attention):
    def __init__(self, a: Any, layer: int):
        super().__init__(a)
        self.layer = layer
        e = a.ext
        if e.head_norm:
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.eps), RMSNorm(a.head_dim, a.eps)
        elif e.full_norm:
            self.q_norm = RMSNorm(a.heads * a.head_dim, a.eps)
            self.k_norm = RMSNorm(a.kv_heads * a.head_dim, a.eps)

    def forward(self, x: torch.Tensor, rope: tuple | None, attend: Callable) -> torch.Tensor:
        a, e, n = self.a, self.a.ext, x.shape[0]
        q, k, v = lora_add(self, x, rows_linear(x, *self.qkv)).split(self.splits, dim=-1)
        if e.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(n, a.heads, a.head_dim), k.view(n, a.kv_heads, a.head_dim), v.view(n, a.kv_heads, a.head_dim)
        if e.head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # cos/sin [n, 1, rot]
            q, k = rotate(q, *rope), rotate(k, *rope)
        return out_proj(self.o_proj, attend(self.layer, q, k, v))


class ExtBlock(nn.Module):
    def __init__(self, a: Any, layer: int):
        super().__init__()
        self.style = a.ext.style
        for name in NORMS[self.style]:
            setattr(self, name, RMSNorm(a.hidden, a.eps))
        self.self_attn = ExtAttention(a, layer)
        self.mlp = MLP(a.hidden, a.intermediate, gelu=a.arch in GEMMA)

    def forward(self, x: torch.Tensor, rope: tuple | None, attend: Callable) -> torch.Tensor:
        s = self.style
        h = self.self_attn(x if s == "post" else self.input_layernorm(x), rope, attend)
        x = x + (h if s == "pre" else self.post_attention_layernorm(h))
        h = {
            "pre": self.post_attention_layernorm,
            "sandwich": getattr(self, "pre_feedforward_layernorm", None),
            "post": None,
        }[s]
        h = mlp_rows(self.mlp, x if h is None else h(x))
        return x + (h if s == "pre" else self.post_feedforward_layernorm(h))


class CoreTransformer(Transformer):
    """A ``Transformer`` whose blocks take ``(x, rope, attend)`` and bring their own attention core
    (``_core(layer)``: ``(q [H, T, D], keys, values, start, window) -> [T, H*Dv]``): this module's and
    archs_moe.py's.  Its forwards are forward.blocks with attend.py's ``Core*`` attend objects;
    ``decode_rows`` is decode_rows.decode_batch for these layers.  Per-sequence caches only."""

    def _core(self, layer: int) -> Callable:
        raise NotImplementedError

    def _ropes(self, pos: torch.Tensor, last: torch.Tensor, dtype: torch.dtype) -> list:
        """Each layer's rope rows for rows at ``pos`` (``last``: each row's forward's last position)."""
        raise NotImplementedError

    def _restart(self, kv: SeqCache, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """Token ids to run again from position 0 instead of this forward (longrope's switch), else None."""
        return None

    def _restart_rows(self, caches: list, ids: torch.Tensor, positions: list[int]) -> torch.Tensor | None:
        """``decode_rows``' logits when its rows must run another way (longrope's switch), else None."""
        return None

    def hidden(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = False) -> torch.Tensor:
        a = self.a
        x = self.embed(tokens)
        T, dev = tokens.shape[0], x.device
        if isinstance(kv, PackedAttend):
            lengths = torch.tensor(kv.lengths, device=dev)
            pos, last = kv.positions, torch.repeat_interleave(lengths - 1, lengths)
            io: Any = CorePackedAttend(a, self._core, kv.lengths)
        elif isinstance(kv, SeqCache):
            if (ids := self._restart(kv, tokens, start)) is not None:
                out = self.hidden(ids, kv, 0, last_only)  # the whole sequence again
                return out if last_only else out[-T:]
            pos = torch.arange(start, start + T, device=dev)
            last = torch.full((T,), start + T - 1, device=dev)
            io = CoreCacheAttend(a, self._core, kv, start)
        else:
            raise compressed_refused(a)
        x = blocks(self, x, self._ropes(pos, last, x.dtype), io.attend)
        return self.norm(x[-1:] if last_only else x)

    def decode_rows(
        self, caches: list, tokens: Any, positions: list[int], x: torch.Tensor | None = None, head: bool = True
    ) -> torch.Tensor:
        """One decode token for each of B sequences: the matmuls on [B, hidden] rows, attention per
        sequence over its own cache (decode_rows.decode_batch for this module's layers).  Logits [B, V]."""
        a, dev = self.a, self.embed_tokens.weight.device
        if not all(isinstance(c, SeqCache) for c in caches):
            raise compressed_refused(a)
        if x is None:
            ids = token_ids(tokens, dev)
            if (out := self._restart_rows(caches, ids.view(-1), positions)) is not None:
                return out
            x = self.embed(ids)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        x = blocks(self, x, self._ropes(pos, pos, x.dtype), CoreRowsAttend(a, self._core, caches, positions).attend)
        return self.head(self.norm(x)) if head else x


class ExtTransformer(CoreTransformer):
    """``CoreTransformer`` with this module's layers."""

    def __init__(self, a: Any):
        super().__init__(a)
        self.layers = nn.ModuleList(ExtBlock(a, i) for i in range(a.layers))
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _core(self, layer: int) -> Callable:
        return partial(attention, self.a.ext)

    def init_rope(self) -> None:
        a, e, dev = self.a, self.a.ext, self.embed_tokens.weight.device
        self.tables = {}
        if e.longrope is not None:
            self.tables = {
                "short": longrope_tables(a, e.longrope, False, dev),
                "long": longrope_tables(a, e.longrope, True, dev),
            }
        else:
            for name, (theta, scaling) in e.tables.items():
                self.tables[name] = rope_tables(
                    replace(a, rope_theta=theta, rope_scaling=scaling, head_dim=e.rot_dim), dev
                )
        self.cos, self.sin = next(iter(self.tables.values()))  # build.finish_load / check_device read these

    def _ropes(self, pos: torch.Tensor, last: torch.Tensor, dtype: torch.dtype) -> list:
        ropes = self._tables(pos, self._long(last), dtype)
        return [None if name is None else ropes[name] for name in self.a.ext.ropes]

    def _tables(self, pos: torch.Tensor, long: torch.Tensor | None, dtype: torch.dtype) -> dict:
        """{table name: (cos, sin) [n, 1, rot]} for rows at ``pos``; longrope: the long table where ``long``."""
        dev = pos.device  # as transformers: the tables in the model's dtype
        tabs = self.tables = {k: (c.to(dev, dtype), s.to(dev, dtype)) for k, (c, s) in self.tables.items()}
        if self.a.ext.longrope is not None:
            (cs, ss), (cl, sl) = tabs["short"], tabs["long"]
            m = long.view(-1, 1)
            rows = (torch.where(m, cl[pos], cs[pos]).unsqueeze(1), torch.where(m, sl[pos], ss[pos]).unsqueeze(1))
            return {name: rows for name in self.a.ext.tables}
        return {k: (c[pos].unsqueeze(1), s[pos].unsqueeze(1)) for k, (c, s) in tabs.items()}

    def _long(self, last: torch.Tensor) -> torch.Tensor | None:
        """Per row: whether its forward's last position is past the original context (longrope)."""
        lr = self.a.ext.longrope
        return None if lr is None else last + 1 > lr["original"]

    def _restart(self, kv: SeqCache, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """Longrope's switch, as transformers' Phi-3: the first forward that takes a sequence past
        ``original_max_position_embeddings`` drops its cache (rows computed with the short factors) and
        re-runs the whole sequence with the long ones.  The sequence's tokens are kept on its cache for
        that; returns them when this forward is such a switch, else None."""
        lr, T = self.a.ext.longrope, tokens.shape[0]
        if lr is None:
            return None
        ids = kv.__dict__.get("longrope_ids")
        known = start == 0 or (ids is not None and ids.shape[0] >= start)
        kv.longrope_ids = torch.cat([ids[:start], tokens]) if start and known else tokens.clone() if known else None
        if 0 < start <= lr["original"] < start + T:
            if not known:
                raise NotImplementedError(
                    f"rope_scaling.rope_type='longrope' ({self.a.arch}): a sequence whose first "
                    f"{start} positions were restored from the prompt cache cannot switch to the "
                    f"long factors past original_max_position_embeddings={lr['original']}"
                )
            return kv.longrope_ids
        return None

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = rows_linear(x, head_weight(self))
        cap = self.a.ext.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _restart_rows(self, caches: list, ids: torch.Tensor, positions: list[int]) -> torch.Tensor | None:
        lr = self.a.ext.longrope
        if lr is None:
            return None
        if any(0 < p <= lr["original"] < p + 1 for p in positions):  # a row switches: one at a time
            return torch.cat([self.forward(ids[b : b + 1], c, p) for b, (c, p) in enumerate(zip(caches, positions))])
        for b, (c, p) in enumerate(zip(caches, positions)):
            self._restart(c, ids[b : b + 1], p)
        return None
