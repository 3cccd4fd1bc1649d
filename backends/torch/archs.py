"""Architectures beyond the llama family, native in the torch backend: Gemma 2, Gemma 3 (text),
Phi-3 / Phi-4, OLMo 2 and SmolLM3.  model.py keeps the llama-family layer; this module adds the
math those five change, on the same weights-by-HF-name, ``SeqCache`` and ``PackedAttend``:

- Gemma 2 / 3: attention-logit and final-logit soft-capping (tanh), ``query_pre_attn_scalar``
  as the attention scale, norms before *and* after attention and MLP ((1 + w) RMSNorm, folded
  at load by model.build), alternating sliding / global layers (``layer_types``); Gemma 3 adds
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
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .decode_rows import _mlp_rows
from .kv_cache import SeqCache
from .linear_rows import lora_add, out_proj, rows_linear
from .model import MLP, Attention, PackedAttend, RMSNorm, Transformer, window_mask
from .rope import apply_rope, rope_params, rope_tables, rope_type

ARCHS = ("gemma2", "gemma3_text", "phi3", "olmo2", "smollm3")  # model_config.EXTRA_ARCHS names the same
GEMMA = ("gemma2", "gemma3_text")
STYLE = {"gemma2": "sandwich", "gemma3_text": "sandwich", "olmo2": "post", "phi3": "pre", "smollm3": "pre"}
# the norms of each placement, by their HF names
NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


@dataclass
class Ext:
    """What an architecture of this module changes (``Args.ext``)."""

    style: str  # norm placement: "pre" (llama), "sandwich" (Gemma 2/3), "post" (OLMo 2)
    scale: float  # attention score scale
    attn_softcap: float | None  # tanh soft cap of attention logits
    final_softcap: float | None  # tanh soft cap of the output logits
    head_norm: bool  # q/k RMSNorm per head (Gemma 3)
    full_norm: bool  # q/k RMSNorm over the whole projection (OLMo 2)
    ropes: tuple  # per layer: the rope table's name, or None (a NoPE layer)
    tables: dict  # rope table name -> (rope_theta, rope scaling dict or None)
    rot_dim: int  # rotary dimensions (head_dim x partial_rotary_factor)
    longrope: dict | None = None  # Phi-3: short_factor, long_factor, original_max_position_embeddings


def _gemma3_ropes(c: dict) -> dict:
    """{layer type: rope dict} from either transformers 5's nested ``rope_parameters`` or the
    checkpoint's own fields (``rope_theta`` + ``rope_scaling`` global, ``rope_local_base_freq``)."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
    else:
        full = dict(c.get("rope_scaling") or (rp if isinstance(rp, dict) else None) or {})
        local = {}
    full.setdefault("rope_theta", c.get("rope_theta") or 1_000_000.0)
    local.setdefault("rope_theta", c.get("rope_local_base_freq") or 10_000.0)
    return {"full_attention": full, "sliding_attention": local}


def _layer_types(c: dict) -> list[str]:
    arch, n = c["model_type"], c["num_hidden_layers"]
    if c.get("layer_types"):
        return list(c["layer_types"])
    if arch == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if arch == "gemma3_text":
        p = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6
        return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]
    if arch == "phi3":
        return ["sliding_attention"] * n
    if arch == "smollm3":
        if not c.get("use_sliding_window"):
            return ["full_attention"] * n
        return ["sliding_attention" if i >= c.get("max_window_layers", 28) else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def layer_windows(c: dict, ctx: int) -> tuple:
    """Per-layer sliding-window widths (0: full attention), as transformers applies them."""
    w = c.get("sliding_window")
    if c["model_type"] == "gemma2" and "sliding_window" not in c:
        w = 4096  # Gemma2Config's default
    if not w or c["model_type"] == "olmo2" or (c["model_type"] == "smollm3" and not c.get("use_sliding_window")):
        return ()
    out = tuple(int(w) if k == "sliding_attention" and int(w) < ctx else 0 for k in _layer_types(c))
    return out if any(out) else ()


def _rot_dim(c: dict, head_dim: int) -> int:
    rs = rope_params(c) or {}
    f = c.get("partial_rotary_factor") or rs.get("partial_rotary_factor") or 1.0
    return int(head_dim * f)


def check_fields(c: dict, refuse: Callable[[str, Any], None]) -> dict:
    """Refuse what these architectures do not implement (one sentence naming field and value), and
    return ``c`` less the fields implemented here, for model_config.check_config's generic checks."""
    arch = c["model_type"]
    c = dict(c)
    if c.get("attention_bias"):
        refuse("attention_bias", c["attention_bias"])
    if arch in GEMMA:
        act = c.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            refuse("hidden_activation", act)
        if c.get("use_bidirectional_attention"):
            refuse("use_bidirectional_attention", c["use_bidirectional_attention"])
        for f in (
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "query_pre_attn_scalar",
            "hidden_act",
            "hidden_activation",
            "use_bidirectional_attention",
        ):
            c.pop(f, None)
    if arch == "gemma3_text":
        for kind, rs in _gemma3_ropes(c).items():
            if rope_type(rs) not in ("default", "linear"):
                refuse(f"rope_parameters.{kind}.rope_type", rope_type(rs))
        c.pop("rope_parameters", None)
        c.pop("rope_scaling", None)
    if arch == "phi3":
        rs = rope_params(c) or {}
        half = _rot_dim(c, c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) // 2
        c.pop("partial_rotary_factor", None)
        if rs.get("partial_rotary_factor") is not None:
            f = rs["partial_rotary_factor"]
            head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            if int(head_dim * f) % 2:
                refuse("partial_rotary_factor", f)
        if rope_type(rs) == "longrope":
            for f in ("short_factor", "long_factor"):
                if len(rs.get(f) or ()) != half:
                    refuse(f"rope_scaling.{f}", rs.get(f))
            if not (rs.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")):
                refuse("original_max_position_embeddings", None)
            c.pop("rope_scaling", None)
            c.pop("rope_parameters", None)
        elif rs:
            c["rope_scaling"] = {k: v for k, v in rs.items() if k != "partial_rotary_factor"}
            c.pop("rope_parameters", None)
    if arch == "smollm3":
        nope = c.get("no_rope_layers")
        if nope is not None and (len(nope) != c["num_hidden_layers"] or set(nope) - {0, 1}):
            refuse("no_rope_layers", nope)
        c.pop("no_rope_layers", None)
    return c


def settings(c: dict) -> Ext:
    """``Args.ext`` for an architecture of this module (the config already passed ``check_fields``)."""
    arch, n = c["model_type"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rs = rope_params(c) or {}
    theta = c.get("rope_theta") or rs.get("rope_theta") or 10000.0
    plain = (
        None
        if rope_type(rs) in ("default", "longrope")
        else {k: v for k, v in rs.items() if k != "partial_rotary_factor"}
    )
    tables: dict = {"global": (theta, plain)}
    ropes: list = ["global"] * n
    longrope = None
    if arch == "gemma3_text":
        r = _gemma3_ropes(c)
        tables = {k: (d["rope_theta"], None if rope_type(d) == "default" else d) for k, d in r.items()}
        ropes = _layer_types(c)
    if arch == "smollm3":
        nope = c.get("no_rope_layers")
        if nope is None:
            every = c.get("no_rope_layer_interval", 4)
            nope = [int((i + 1) % every != 0) for i in range(n)]
        ropes = ["global" if use else None for use in nope]
    if arch == "phi3" and rope_type(rs) == "longrope":
        orig = rs.get("original_max_position_embeddings") or c["original_max_position_embeddings"]
        longrope = {
            "short_factor": rs["short_factor"],
            "long_factor": rs["long_factor"],
            "original": int(orig),
            "factor": rs.get("factor") or c.get("max_position_embeddings", orig) / orig,
            "attention_factor": rs.get("attention_factor"),
        }
    qpas = c.get("query_pre_attn_scalar") if arch in GEMMA else None
    if arch == "gemma2" and qpas is None:
        qpas = 256  # Gemma2Config's default
    return Ext(
        style=STYLE[arch],
        scale=(qpas or head_dim) ** -0.5,
        attn_softcap=c.get("attn_logit_softcapping", 50.0 if arch == "gemma2" else None) if arch in GEMMA else None,
        final_softcap=c.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None) if arch in GEMMA else None,
        head_norm=arch == "gemma3_text",
        full_norm=arch == "olmo2",
        ropes=tuple(ropes),
        tables=tables,
        rot_dim=_rot_dim(c, head_dim) if arch == "phi3" else head_dim,
        longrope=longrope,
    )


def cuda_feature(a: Any) -> str:
    """The feature that keeps this architecture off the CUDA fast path (named in the load log)."""
    e = a.ext
    if e.attn_softcap:
        return f"attn_logit_softcapping={e.attn_softcap}"
    if a.arch == "gemma3_text":
        return "q/k norms and a rope base per layer type"
    if e.longrope:
        return "rope_scaling.rope_type='longrope'"
    if e.rot_dim != a.head_dim:
        return f"partial_rotary_factor={e.rot_dim / a.head_dim}"
    if e.style == "post":
        return "norms after attention and MLP, q/k norms over the whole projection"
    if None in e.ropes or a.arch == "smollm3":
        return "no_rope_layers"
    return "fused qkv_proj / gate_up_proj" if a.arch == "phi3" else "its layer"


def refuse_flag(a: Any, flag: str) -> None:
    """Raise ConfigError for a flag whose code path runs the llama-family layer only."""
    if getattr(a, "ext", None) is not None:
        from swiftlm.errors import ConfigError

        raise ConfigError(
            f"{flag} is not available for architecture {a.arch!r}, whose layer the torch backend "
            "runs on a single process only; serve this model without it"
        )


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
        mask = (
            window_mask(T, S, S - T, window, q.device)
            if window
            else torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        )
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
        h = _mlp_rows(self.mlp, x if h is None else h(x))
        return x + (h if s == "pre" else self.post_feedforward_layernorm(h))


class ExtTransformer(Transformer):
    """``Transformer`` with this module's layers; ``decode_rows`` is decode_rows.decode_batch for it."""

    def __init__(self, a: Any):
        super().__init__(a)
        self.layers = nn.ModuleList(ExtBlock(a, i) for i in range(a.layers))
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

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
        self.cos, self.sin = next(iter(self.tables.values()))  # model.finish_load / check_device read these

    def _ropes(self, pos: torch.Tensor, long: torch.Tensor | None, dtype: torch.dtype) -> dict:
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

    def _longrope_ids(self, kv: SeqCache, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """Longrope's switch, as transformers' Phi-3: the first forward that takes a sequence past
        ``original_max_position_embeddings`` drops its cache (rows computed with the short factors) and
        re-runs the whole sequence with the long ones.  The sequence's tokens are kept on its cache for
        that; returns them when this forward is such a switch, else None."""
        lr, T = self.a.ext.longrope, tokens.shape[0]
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

    def _layers(self, x: torch.Tensor, ropes: dict, attend: Callable) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            name = self.a.ext.ropes[i]
            x = layer(x, None if name is None else ropes[name], attend)
        return x

    def hidden(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = False) -> torch.Tensor:
        a = self.a
        x = self.embed(tokens)
        T, dev = tokens.shape[0], x.device
        if isinstance(kv, PackedAttend):
            pos = kv.positions
            lengths = torch.tensor(kv.lengths, device=dev)
            last = torch.repeat_interleave(lengths - 1, lengths)

            def attend(layer, q, k, v):
                outs = [
                    attention(a.ext, qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), 0, a.window(layer))
                    for qs, ks, vs in zip(q.split(kv.lengths), k.split(kv.lengths), v.split(kv.lengths))
                ]
                return torch.cat(outs)
        elif isinstance(kv, SeqCache):
            if a.ext.longrope is not None and (ids := self._longrope_ids(kv, tokens, start)) is not None:
                out = self.hidden(ids, kv, 0, last_only)  # the whole sequence again, with the long factors
                return out if last_only else out[-T:]
            pos = torch.arange(start, start + T, device=dev)
            last = torch.full((T,), start + T - 1, device=dev)

            def attend(layer, q, k, v):
                keys, values = kv.update(layer, start, k.transpose(0, 1), v.transpose(0, 1))
                return attention(a.ext, q.transpose(0, 1), keys, values, start, a.window(layer))
        else:
            raise compressed_refused(a)
        x = self._layers(x, self._ropes(pos, self._long(last), x.dtype), attend)
        if last_only:
            x = x[-1:]
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = True) -> torch.Tensor:
        return self.head(self.hidden(tokens, kv, start, last_only))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = rows_linear(x, w)
        cap = self.a.ext.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decode_rows(
        self, caches: list, tokens: Any, positions: list[int], x: torch.Tensor | None = None, head: bool = True
    ) -> torch.Tensor:
        """One decode token for each of B sequences: the matmuls on [B, hidden] rows, attention per
        sequence over its own cache (decode_rows.decode_batch for this module's layers).  Logits [B, V]."""
        a, dev = self.a, self.embed_tokens.weight.device
        if not all(isinstance(c, SeqCache) for c in caches):
            raise compressed_refused(a)
        if a.ext.longrope is not None and x is None:
            ids = (
                tokens.long().view(-1)
                if torch.is_tensor(tokens)
                else torch.tensor(tokens, dtype=torch.long, device=dev)
            )
            if any(0 < p <= a.ext.longrope["original"] < p + 1 for p in positions):  # a row switches: one at a time
                return torch.cat(
                    [self.forward(ids[b : b + 1], c, p) for b, (c, p) in enumerate(zip(caches, positions))]
                )
            for b, (c, p) in enumerate(zip(caches, positions)):
                self._longrope_ids(c, ids[b : b + 1], p)
        if x is None:
            x = self.embed(
                tokens.long() if torch.is_tensor(tokens) else torch.tensor(tokens, dtype=torch.long, device=dev)
            )
        pos = torch.tensor(positions, dtype=torch.long, device=dev)

        def attend(layer, q, k, v):  # q [B, H, D], k/v [B, KVH, D]
            outs = []
            for b, (c, p) in enumerate(zip(caches, positions)):
                keys, values = c.update(layer, p, k[b].unsqueeze(1), v[b].unsqueeze(1))
                outs.append(attention(a.ext, q[b].unsqueeze(1), keys, values, p, a.window(layer)))
            return torch.cat(outs)

        x = self._layers(x, self._ropes(pos, self._long(pos), x.dtype), attend)
        return self.head(self.norm(x)) if head else x
