"""Decoder-only transformer for the llama family in plain torch (llama, mistral, qwen2, qwen3,
and the MoE variants qwen3_moe / qwen2_moe / mixtral), with this project's own KV cache.

Why our own model file and not transformers' modeling classes: a decode step here is a few
fused calls per layer on preallocated cache slices (no cache objects, masks or hooks rebuilt
per token), which is what makes small models fast on CPU and lets CUDA graphs capture a step.
Weights use HF names, so HF checkpoints load as they are.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .offload import from_offload, layer_places, place, to_offload

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma",
             "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3", "gpt_oss", "deepseek_v2", "deepseek_v3")
EXTRA_ARCHS = ("gemma2", "gemma3_text", "phi3", "olmo2", "smollm3")  # their layers: archs.py
MOE_ARCHS = ("gpt_oss", "deepseek_v2", "deepseek_v3")  # their layers: archs_moe.py


@dataclass
class Args:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    ctx: int
    tie: bool
    attn_bias: bool
    qk_norm: bool
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = True
    shared_intermediate: int = 0
    rope_scaling: dict | None = None
    gemma: bool = False  # sqrt(hidden) embedding scale, (1 + w) norms, GeGLU (tanh GELU)
    offload: Any = None  # --gpu-layers: (first CPU layer, its device, its dtype); see offload.py
    windows: tuple = ()  # per layer: sliding-window width in keys (0: full causal attention)
    ext: Any = None  # archs.Ext: what an EXTRA_ARCHS architecture changes (soft caps, norms, ropes, ...)

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def eager_reason(self, ctx: int | None = None) -> str | None:
        """Why this model runs on the eager path on CUDA (per-sequence caches and eager forwards, no slot
        pool, CUDA graphs, packed prefill or paged attention: those run the llama-family layer over every
        key), or None.  ``ctx``: the served context; a window no shorter than it changes nothing."""
        if self.ext is not None:
            if self.arch in MOE_ARCHS:
                from .archs_moe import cuda_feature as moe_feature

                return f"architecture {self.arch!r} ({moe_feature(self)})"
            from .archs import cuda_feature

            return f"architecture {self.arch!r} ({cuda_feature(self)})"
        live = [w for w in self.windows if w and (ctx is None or w < ctx)]
        return f"config field sliding_window={max(live)}" if live else None

    @property
    def needs_eager(self) -> bool:
        """On CUDA this model runs eagerly (``eager_reason``): no slot pool, CUDA graphs or paged attention."""
        return self.eager_reason() is not None

    @classmethod
    def from_config(cls, c: dict) -> "Args":
        arch = c["model_type"]
        heads = c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        check_config(c)
        rs = rope_params(c)
        ctx = c.get("max_position_embeddings", 4096)
        if rope_type(rs) == "yarn" and rs.get("factor") and rs.get("original_max_position_embeddings"):
            ctx = max(ctx, int(rs["original_max_position_embeddings"] * rs["factor"]))  # YaRN's extended context
        a = cls(arch=arch, hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   intermediate=c.get("intermediate_size", 0), vocab=c["vocab_size"],
                   eps=c.get("rms_norm_eps", 1e-6),
                   rope_theta=c.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0,
                   ctx=ctx, tie=c.get("tie_word_embeddings", False),
                   attn_bias=c.get("attention_bias", arch in ("qwen2", "qwen2_moe")),
                   qk_norm=arch in ("qwen3", "qwen3_moe"), experts=experts,
                   top_k=c.get("num_experts_per_tok", 0),
                   moe_intermediate=c.get("moe_intermediate_size") or c.get("intermediate_size", 0),
                   norm_topk=c.get("norm_topk_prob", arch == "mixtral"),
                   shared_intermediate=c.get("shared_expert_intermediate_size", 0),
                   rope_scaling=rs, gemma=arch in ("gemma", "gemma2", "gemma3_text"), windows=sliding_windows(c, ctx),
                   ext=extension(c))
        if arch in MOE_ARCHS:  # fields under other names; MLA's latent cache layout
            from .archs_moe import adjust_args

            adjust_args(a, c)
        return a


def extension(c: dict) -> Any:
    """archs.settings / archs_moe.settings for the architectures they add (None for the llama family)."""
    if c["model_type"] in MOE_ARCHS:
        from .archs_moe import settings as moe_settings

        return moe_settings(c)
    if c["model_type"] not in EXTRA_ARCHS:
        return None
    from .archs import settings

    return settings(c)


ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")


def rope_params(c: dict) -> dict | None:
    """The rope scaling dict, under either name (transformers 5 writes ``rope_parameters``)."""
    rs = c.get("rope_scaling") or c.get("rope_parameters")
    return dict(rs) if isinstance(rs, dict) else None


def rope_type(rs: dict | None) -> str:
    return str((rs or {}).get("rope_type", (rs or {}).get("type", "default")) or "default")


def sliding_windows(c: dict, ctx: int) -> tuple:
    """Per-layer sliding-window widths as transformers applies them (0: full attention).  Mistral,
    Mixtral and Qwen3-MoE slide every layer; Qwen2/Qwen3/Qwen2-MoE slide the layers ``layer_types``
    names (derived from ``use_sliding_window`` and ``max_window_layers`` when absent).  Llama and
    Gemma(1) have no sliding window.  A window no shorter than the context changes nothing."""
    arch, n, w = c["model_type"], c["num_hidden_layers"], c.get("sliding_window")
    if arch in EXTRA_ARCHS:
        from .archs import layer_windows

        return layer_windows(c, ctx)
    if arch in MOE_ARCHS:
        from .archs_moe import layer_windows as moe_windows

        return moe_windows(c, ctx)
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not c.get("use_sliding_window", False):
        w = None
    if not w or arch in ("llama", "gemma"):
        return ()
    if arch in ("mistral", "mixtral", "qwen3_moe"):
        kinds = ["sliding_attention"] * n
    else:
        kinds = c.get("layer_types") or ["sliding_attention" if i >= c.get("max_window_layers", 28)
                                         else "full_attention" for i in range(n)]
    out = tuple(int(w) if k == "sliding_attention" and int(w) < ctx else 0 for k in kinds)
    return out if any(out) else ()


def check_config(c: dict) -> None:
    """Refuse, in one sentence naming the field and its value, any config field that changes the
    computation and that this model file does not implement (nothing is dropped silently)."""
    from swiftlm.errors import UnsupportedArchitecture

    def refuse(field: str, value: Any) -> None:
        raise UnsupportedArchitecture(f"config field {field}={value!r} ({c['model_type']}) is not implemented by "
                                      "the torch backend's native path")

    if c["model_type"] in EXTRA_ARCHS:  # archs.py refuses its own and takes out the fields it implements
        from .archs import check_fields

        c = check_fields(c, refuse)
    if c["model_type"] in MOE_ARCHS:  # as archs.py, for archs_moe.py's
        from .archs_moe import check_fields as moe_check_fields

        c = moe_check_fields(c, refuse)
    rs = rope_params(c) or {}
    if rope_type(rs) not in ROPE_TYPES:
        refuse("rope_scaling.rope_type", rope_type(rs))
    for field in ("partial_rotary_factor",):
        for where, d in (("", c), ("rope_scaling.", rs)):
            if d.get(field) not in (None, 1, 1.0):
                refuse(where + field, d[field])
    if rope_type(rs) == "yarn":
        for field in ("mscale", "mscale_all_dim"):
            if rs.get(field):
                refuse(f"rope_scaling.{field}", rs[field])
        if not rs.get("original_max_position_embeddings"):
            refuse("rope_scaling.original_max_position_embeddings", rs.get("original_max_position_embeddings"))
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "query_pre_attn_scalar",
                  "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if c.get(field) is not None:
            refuse(field, c[field])
    for field in ("mlp_bias", "use_qk_norm"):
        if c.get(field):
            refuse(field, c[field])
    if c["model_type"] == "gemma":
        if c.get("hidden_activation") not in (None, "gelu_pytorch_tanh"):
            refuse("hidden_activation", c["hidden_activation"])
    elif c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", c["hidden_act"])
    if c.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step", c["decoder_sparse_step"])
    if c.get("mlp_only_layers"):
        refuse("mlp_only_layers", c["mlp_only_layers"])
    kinds = set(c.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        refuse("layer_types", sorted(kinds)[0])


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(a: Args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
    rs = a.rope_scaling or {}
    kind, attn_factor = rope_type(rs), 1.0
    # "dynamic" (NTK) rescales only past max_position_embeddings, which is also our context limit
    # (Args.ctx): within it transformers computes the plain frequencies, and so do we.
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "yarn":  # YaRN (Qwen2.5 long context): per-frequency blend of interpolation and extrapolation
        factor, dim, base = rs["factor"], a.head_dim, a.rope_theta
        old = rs["original_max_position_embeddings"]
        attn_factor = rs.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr(rot: float) -> float:
            return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr(rs.get("beta_fast") or 32), corr(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        inv = inv / factor * (1 - extrap) + inv * extrap
    if kind == "llama3":  # Llama-3.1 frequency scaling
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    t = torch.arange(a.ctx, dtype=torch.float64)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attn_factor).float().to(device), (emb.sin() * attn_factor).float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden, a.heads * a.head_dim, bias=a.attn_bias)
        self.k_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=a.attn_bias)
        self.v_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=a.attn_bias)
        self.o_proj = nn.Linear(a.heads * a.head_dim, a.hidden, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.eps)
            self.k_norm = RMSNorm(a.head_dim, a.eps)

    def fuse(self) -> None:
        """One [q; k; v] matmul instead of three (fewer, larger GEMVs per decode step)."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = (torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) if self.a.attn_bias else None)
        self.qkv = (w, b)
        self.splits = (self.a.heads * self.a.head_dim, self.a.kv_heads * self.a.head_dim,
                       self.a.kv_heads * self.a.head_dim)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: "SeqCache", layer: int,
                start: int) -> torch.Tensor:
        a = self.a
        T = x.shape[0]
        q, k, v = lora_add(self, x, rows_linear(x, *self.qkv)).split(self.splits, dim=-1)
        q = q.view(T, a.heads, a.head_dim)
        k = k.view(T, a.kv_heads, a.head_dim)
        v = v.view(T, a.kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [H, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin)
        w = a.window(layer)
        if isinstance(kv, PackedAttend):
            return linear_rows(self.o_proj, kv.update_attend(layer, start, q, k, v.transpose(0, 1), window=w))
        if not isinstance(kv, SeqCache):  # a compressed cache attends over its own layout
            if w and start + T > w:
                raise NotImplementedError(f"sliding_window={w} is not implemented for a compressed KV cache; "
                                          "use the plain KV format for this model")
            return linear_rows(self.o_proj, kv.update_attend(layer, start, q, k, v.transpose(0, 1)))
        keys, values = kv.update(layer, start, k, v.transpose(0, 1))  # [KVH, start+T-offset, D]
        rep = a.heads // a.kv_heads
        if w and T == 1:  # sliding window: the last w keys
            keys, values = keys[:, -w:], values[:, -w:]
        if w and start + T > w and T > 1:
            # a window layer may have dropped its oldest rows (SeqCache): the keys are positions
            # [start + T - S, start + T), so the chunk starts at row S - T
            out = chunk_attention(q, keys, values, keys.shape[1] - T, rep, window=w)
        elif T == 1:
            # One query row attends to everything so far: two small matmuls beat the fused
            # kernel's setup cost on CPU (measured ~1 ms/layer for SDPA vs ~0.1 ms here).
            S = keys.shape[1]
            qg = q.reshape(a.kv_heads, rep, a.head_dim)
            scores = torch.matmul(qg, keys.transpose(1, 2)) * (a.head_dim ** -0.5)  # [KVH, rep, S]
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            out = torch.matmul(probs, values).reshape(a.heads, 1, a.head_dim)
            return linear_rows(self.o_proj, out.transpose(0, 1).reshape(1, a.heads * a.head_dim))
        elif start == 0:
            out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                 is_causal=True, enable_gqa=rep > 1)
        else:  # a prefill chunk after earlier positions: causal within the chunk, full to the past
            out = chunk_attention(q, keys, values, start, rep)
        return linear_rows(self.o_proj, out[0].transpose(0, 1).reshape(T, a.heads * a.head_dim))


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, rep: int,
                    window: int = 0) -> torch.Tensor:
    """Attention of a prompt chunk at positions [start, start + T) over keys [0, start + T): causal
    within the chunk, full to the past.  On CUDA through a lower-right causal bias, which SDPA runs in
    its flash kernel; an explicit [T, S] mask sent every chunk of a long prompt to a slow kernel (an
    8B shape on an H100: 100K tokens prefilled at 588 tok/s, 512-token chunks).  Returns [1, H, T, D].
    ``window``: each query sees only the last ``window`` keys up to itself (sliding-window attention)."""
    T, S = q.shape[1], keys.shape[1]
    if window:
        mask = window_mask(T, S, start, window, q.device)
    elif q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        mask: Any = causal_lower_right(T, S)
    else:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                          enable_gqa=rep > 1)


def window_mask(T: int, S: int, start: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool, True where query ``start + i`` may see key ``j``: ``start + i - window < j <= start + i``."""
    ones = torch.ones(T, S, dtype=torch.bool, device=device)
    return ones.tril(diagonal=start) & ones.triu(diagonal=start - window + 1)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, gelu: bool = False):
        super().__init__()
        self.act = (lambda t: F.gelu(t, approximate="tanh")) if gelu else F.silu
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse(self) -> None:
        """One [gate; up] matmul instead of two."""
        self.gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up"):
            g, u = lora_add(self, x, rows_linear(x, self.gate_up)).chunk(2, dim=-1)
            return linear_rows(self.down_proj, self.act(g) * u)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts, stacked as [E, out, in] (filled from per-expert HF tensors)."""

    def __init__(self, a: Args):
        super().__init__()
        E, H, I = a.experts, a.hidden, a.moe_intermediate
        self.a = a
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate = nn.Parameter(torch.empty(E, I, H))
        self.w_up = nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        if a.shared_intermediate:
            self.shared_expert = MLP(H, a.shared_intermediate)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        probs = F.softmax(self.gate(x).float(), dim=-1)
        w, idx = torch.topk(probs, a.top_k, dim=-1)
        if a.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        experts = idx.unique().tolist()
        for j, (wg, wu, wd) in enumerate(self.expert_weights(experts)):
            e = experts[j]
            rows, slot = (idx == e).nonzero(as_tuple=True)
            h = x[rows]
            y = F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
            out.index_add_(0, rows, y * w[rows, slot].unsqueeze(-1))
        if self.a.shared_intermediate:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def expert_weights(self, experts: list[int]) -> Any:
        """(gate, up, down) weights of each expert, in order (resident: views of the stacks)."""
        return [(self.w_gate[e], self.w_up[e], self.w_down[e]) for e in experts]


class Block(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)
        self.self_attn = Attention(a)
        self.mlp = MoE(a) if a.experts else MLP(a.hidden, a.intermediate, gelu=a.gemma)

    def forward(self, x, cos, sin, kv, layer, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class PackedAttend:
    """Attention for several independent sequences packed into one row block (no KV kept):
    causal within each sequence, nothing across them.  Goes where a cache goes
    (``Attention.forward`` calls ``update_attend`` on anything that is not a ``SeqCache``)."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.lengths = lengths
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])

    def update_attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      window: int = 0) -> torch.Tensor:
        if window and max(self.lengths) > window:  # sliding window: one masked attention per sequence
            outs = [chunk_attention(qs, ks, vs, 0, q.shape[0] // k.shape[0], window=window)[0]
                    for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))]
            return torch.cat(outs, dim=1).transpose(0, 1).reshape(q.shape[1], -1)
        # one causal attention per sequence (a block-diagonal mask over the whole pack would cost
        # (sum T)^2 and leave SDPA's fused kernels for its masked fallback: measured 2x slower)
        gqa = q.shape[0] != k.shape[0]
        outs = [F.scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                               enable_gqa=gqa)[0]
                for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))]
        out = torch.cat(outs, dim=1)  # [H, T, D]
        return out.transpose(0, 1).reshape(q.shape[1], -1)


GROW_ROWS = 64  # a growing cache's capacity is a multiple of this


def window_trim_enabled() -> bool:
    """Sliding-window layers drop the KV rows no query can see any more (``SeqCache``).  The switch
    exists for the equivalence tests only (``SWIFTLM_WINDOW_KV_TRIM=0``: keep every row, as before)."""
    return os.environ.get("SWIFTLM_WINDOW_KV_TRIM", "1") != "0"


class WindowRowsDropped(RuntimeError):
    """A reader asked a sliding-window layer for KV rows it has dropped (``SeqCache``)."""


class SeqCache:
    """One sequence's KV cache: per layer [KVH, capacity, D] tensors.  A growing (CPU) cache starts
    at ``GROW_ROWS`` rows and grows to the rows needed plus a quarter, rounded up to ``GROW_ROWS``:
    it holds at most ~1.25x its rows plus one block (doubling from 256 held up to ~3x for short
    sequences: the soak's 200 streams of a few hundred tokens), for ~log1.25 growth copies.

    Sliding-window layers (``Args.window``) keep bounded memory: when such a layer runs out of rows
    (or holds more than a block over what it needs), the rows before ``start - window + 1`` (no query
    of this or any later chunk sees them) are dropped and the rest moved to the front of a buffer of
    ``need = window + T - 1`` rows plus half a block, rounded up to a block: a window layer holds at
    most ``window + T + 2.5 * GROW_ROWS`` rows for a chunk of T (``round_up(window + 32, 64)`` while
    decoding), whatever the sequence length.  ``_off[layer]`` is the absolute position of that
    layer's row 0 (``offset``); ``update`` returns rows [offset, start + T), so
    attention indexes a window layer by ``position - offset`` (the returned rows start at
    ``start + T - rows``: see ``chunk_attention``'s callers).  Rows are cached after rope, so
    dropping old ones needs no re-rotation.  Rollback (speculative verification, recompute) is by
    position and never goes before the start of the last chunk written, whose rows the trim keeps;
    a write that would need dropped rows raises instead of attending over the wrong keys, and so
    does reading ``k`` / ``v`` from outside once rows were dropped (a prompt-cache snapshot or a
    fork copy of rows [0, length) cannot be made then; those callers catch it and recompute)."""

    _off: list | None = None  # per layer: a window layer's first kept position; None: a full layer / no trim

    def __init__(self, a: Args, dtype: torch.dtype, device: torch.device, capacity: int = GROW_ROWS):
        self.a, self.dtype, self.device = a, dtype, device
        self.capacity = min(capacity, a.ctx)
        shape = (a.kv_heads, self.capacity, a.head_dim)
        # zeros, not empty: the fixed-shape decode reads rows past the position (masked out,
        # but 0 * NaN garbage would still be NaN)
        places = layer_places(a, device, dtype)  # --gpu-layers: each layer's rows where the layer is
        self._k = [torch.zeros(shape, dtype=dt, device=dev) for dev, dt in places]
        self._v = [torch.zeros(shape, dtype=dt, device=dev) for dev, dt in places]
        self.length = 0
        if any(getattr(a, "windows", ())) and window_trim_enabled():
            self._off = [0 if a.window(i) else None for i in range(a.layers)]

    # ``k`` / ``v``: every layer's rows by absolute position [0, length), for readers outside this
    # class (CUDA graphs, the prompt cache, forks).  Once a window layer dropped rows there is no such
    # list: reading it raises (the callers that copy rows from position 0 catch it and recompute).
    @property
    def k(self) -> list[torch.Tensor]:
        self._check_whole("k")
        return self._k

    @k.setter
    def k(self, value: list[torch.Tensor]) -> None:
        self._k = value

    @property
    def v(self) -> list[torch.Tensor]:
        self._check_whole("v")
        return self._v

    @v.setter
    def v(self, value: list[torch.Tensor]) -> None:
        self._v = value

    def _check_whole(self, name: str) -> None:
        if self.trimmed:
            raise WindowRowsDropped(f"SeqCache.{name}: sliding-window layers dropped the KV rows before position "
                                    f"{self.window_start}; rows from position 0 are no longer held")

    @property
    def trimmed(self) -> bool:
        """Whether a sliding-window layer dropped rows (then ``k`` / ``v`` by position are gone)."""
        return self._off is not None and any(self._off)

    @property
    def window_start(self) -> int:
        """The lowest first-kept position over the trimmed window layers (0: nothing dropped)."""
        offs = [o for o in (self._off or ()) if o]
        return min(offs) if offs else 0

    def offset(self, layer: int) -> int:
        """The absolute position of ``layer``'s row 0 (0 unless a window layer dropped rows)."""
        return (self._off[layer] or 0) if self._off is not None else 0

    def _grow(self, need: int, full_only: bool = False) -> None:
        """Layers to at least ``need`` rows: all of them (a restore into a fresh cache), or with
        ``full_only`` the full-attention ones (a window layer that drops rows sizes itself)."""
        cap = -(-(need + need // 4) // GROW_ROWS) * GROW_ROWS
        cap = min(max(cap, need), self.a.ctx)
        for lst in (self._k, self._v):
            for i, t in enumerate(lst):
                if self._off is not None and self._off[i] is not None and (full_only or self._off[i] > 0):
                    continue
                if t.shape[1] >= cap:
                    continue
                n = torch.zeros((t.shape[0], cap, t.shape[2]), dtype=t.dtype, device=t.device)
                rows = min(self.length, t.shape[1])
                n[:, :rows] = t[:, :rows]
                lst[i] = n
        self.capacity = cap

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write positions [start, start + T) of ``layer``; its rows [offset(layer), start + T)."""
        if self._off is not None and self._off[layer] is not None:
            return self._update_window(layer, start, k, v)
        end = start + k.shape[1]
        if end > self._k[layer].shape[1]:
            self._grow(end, full_only=True)
        self._k[layer][:, start:end] = k
        self._v[layer][:, start:end] = v
        if layer == self.a.layers - 1:
            self.length = end
        return self._k[layer][:, :end], self._v[layer][:, :end]

    def _update_window(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        w = self.a.window(layer)
        end = start + k.shape[1]
        keep = max(0, start - w + 1)  # the first position a query of this chunk (or any later one) sees
        off = self._off[layer]
        if start == 0:  # the sequence from its start again (longrope's switch): nothing older is read
            off = 0
        elif keep < off:
            raise WindowRowsDropped(f"layer {layer} (sliding window {w}) dropped the KV rows before position {off}; "
                                    f"a write at position {start} needs them from {keep}")
        need, have = end - keep, self._k[layer].shape[1]
        cap = max(min(-(-(need + GROW_ROWS // 2) // GROW_ROWS) * GROW_ROWS, self.a.ctx), need)
        # out of rows, or more than a block over the size needed (after a long prefill chunk or a restored
        # prompt: shrink; the block of hysteresis keeps chunks of varying length from reallocating each step)
        if end - off > have or (keep > off and have > cap + GROW_ROWS):
            # drop the rows before ``keep``: the rows [keep, start) move to the front of a buffer of the rows
            # needed plus at least half a block, so this happens once per half a block of tokens or fewer
            moved = start - keep
            for lst in (self._k, self._v):
                old = lst[layer]
                src = old[:, keep - off:start - off]
                if old.shape[1] == cap:  # in place (the ranges overlap: copy first)
                    old[:, :moved] = src.clone()
                else:
                    new = torch.zeros((old.shape[0], cap, old.shape[2]), dtype=old.dtype, device=old.device)
                    new[:, :moved] = src
                    lst[layer] = new
            off = keep
        self._off[layer] = off
        s, e = start - off, end - off
        self._k[layer][:, s:e] = k
        self._v[layer][:, s:e] = v
        if layer == self.a.layers - 1:
            self.length = end
        return self._k[layer][:, :e], self._v[layer][:, :e]

    def layer_nbytes(self) -> list[int]:
        """Each layer's K and V storage in bytes."""
        return [sum(t.numel() * t.element_size() for t in (kk, vv)) for kk, vv in zip(self._k, self._v)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)


class Transformer(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, a.eps)
        self.lm_head = None if a.tie else nn.Linear(a.hidden, a.vocab, bias=False)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def init_rope(self) -> None:
        self.cos, self.sin = rope_tables(self.a, self.embed_tokens.weight.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.a.gemma:  # Gemma scales embeddings by sqrt(hidden), in the model's dtype
            x = x * torch.tensor(self.a.hidden ** 0.5, dtype=x.dtype)
        return x

    def hidden(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = False) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] (or of the last position only).  With a
        ``PackedAttend`` as ``kv``: several sequences at once, each from position 0."""
        x = self.embed(tokens)
        T = tokens.shape[0]
        if isinstance(kv, PackedAttend):
            cos, sin = self.cos[kv.positions], self.sin[kv.positions]
        else:
            cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        for i, layer in enumerate(self.layers):
            if self.a.offload is not None and i == self.a.offload[0]:
                x, cos, sin = to_offload(self.a, x, cos, sin)
            x = layer(x, cos, sin, kv, i, start)
        if last_only:
            x = x[-1:]
        if self.a.offload is not None:
            x = from_offload(x, self.norm.weight)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor, kv: SeqCache, start: int, last_only: bool = True) -> torch.Tensor:
        x = self.hidden(tokens, kv, start, last_only)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return rows_linear(x, w)


def lora_add(owner: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """LoRA adapters (lora.py): the selected rows' low-rank terms added to a fused projection's output."""
    lo = owner.__dict__.get("lora")
    return y if lo is None else lo(x, y)


def project_qkv(attn: "Attention", x: torch.Tensor, linear: Any = F.linear
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, H, D], k and v [n, KVH, D] for n rows (fused QKV matmul, then q/k norms if any)."""
    a, n = attn.a, x.shape[0]
    q, k, v = lora_add(attn, x, linear(x, *attn.qkv)).split(attn.splits, dim=-1)
    q, k, v = q.view(n, a.heads, a.head_dim), k.view(n, a.kv_heads, a.head_dim), v.view(n, a.kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


_GEMV: list[bool] = []


def _gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """One CUDA row through ``cuda_ext.gemv`` (half-precision weights; the Triton kernels self-checked;
    ``SWIFTLM_GEMV=0`` keeps cuBLAS, for A/B runs)."""
    if not _GEMV:
        import os

        from swiftlm.cuda_ext import enabled

        _GEMV.append(os.environ.get("SWIFTLM_GEMV", "1") != "0" and enabled("cuda"))
    return _GEMV[0] and x.dtype == w.dtype and w.dtype in (torch.bfloat16, torch.float16) and w.is_contiguous()


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a few rows.  On CPU, MKL's sgemm for x @ W^T with 3-64 rows packs the
    whole weight each call and runs up to 2.5x slower than ``(W @ x^T)^T`` (measured on this
    project's CPU: [8, 576] x [49152, 576]^T 21.8 ms vs 12.5 ms).  One or two rows are padded to
    three: MKL's GEMV reads the weights at ~12 GB/s here, its GEMM at ~20-26 GB/s
    (scripts/bench_cpu_linear.py: SmolLM2's layer matrices 34.3 -> 21.6 ms, its LM head 9.3 -> 4.1 ms
    for one row; the padded rows are zeros and their results are dropped).  One row on CUDA (half precision)
    is the Triton matrix-vector kernel of ``cuda_ext.gemv``: on an H100, 5-18% faster than cuBLAS for every
    matrix of the 1B and 8B decode steps (``scripts/bench_gemv.py``, docs/results/gemv_h100.json)."""
    n = x.shape[0]
    if n == 1 and b is None and x.is_cuda and x.dim() == 2 and _gemv_ok(x, w):
        from swiftlm.cuda_ext.gemv import linear_small_m

        return linear_small_m(x.contiguous(), w)
    if x.device.type == "cpu" and x.dim() == 2 and 1 <= n <= 64:
        if n < 3:
            x = torch.cat([x, x.new_zeros(3 - n, x.shape[1])])
        out = (w @ x.t()).t()[:n]
        return out + b if b is not None else out
    return F.linear(x, w, b)


def linear_rows(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` through ``rows_linear`` for a plain ``nn.Linear`` without hooks; any other module (a
    tensor-parallel row layer, an o_proj / down_proj with a LoRA forward hook) is called as it is."""
    if type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks and x.dim() == 2:
        return rows_linear(x, lin.weight, lin.bias)
    return lin(x)


def out_proj(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``rows_linear`` through an output projection (``o_proj`` / ``down_proj``); a tensor-parallel
    row layer (parallel.RowParallelLinear) then sums the ranks' partial outputs."""
    y = lora_add(lin, x, rows_linear(x, lin.weight))
    reduce = getattr(lin, "reduce", None)
    return reduce(y) if reduce is not None else y


def _mlp_rows(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(mlp, MLP) or not hasattr(mlp, "gate_up"):
        return mlp(x)
    g, u = lora_add(mlp, x, rows_linear(x, mlp.gate_up)).chunk(2, dim=-1)
    return out_proj(mlp.down_proj, mlp.act(g) * u)


def _row_attention(attn: "Attention", cache: Any, layer: int, pos: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
    """One sequence's decode-row attention (q [H, D], k/v [KVH, D]) -> [1, H*D]."""
    a = attn.a
    if not isinstance(cache, SeqCache):
        return cache.update_attend(layer, pos, q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
    keys, values = cache.update(layer, pos, k.unsqueeze(1), v.unsqueeze(1))
    if a.window(layer):  # sliding window: the last w keys
        keys, values = keys[:, -a.window(layer):], values[:, -a.window(layer):]
    qg = q.reshape(a.kv_heads, a.heads // a.kv_heads, a.head_dim)
    probs = torch.softmax((qg @ keys.transpose(1, 2) * a.head_dim ** -0.5).float(), dim=-1).to(values.dtype)
    return (probs @ values).reshape(1, a.heads * a.head_dim)


def _prefix_groups(caches: list[Any]) -> list[tuple[Any, list[int]]]:
    """Rows whose caches share one prefix (shared_kv.ForkedCache): [(prefix, row indices)]."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for b, c in enumerate(caches):
        p = getattr(c, "prefix", None)
        if p is not None:
            groups.setdefault(id(p), (p, []))[1].append(b)
    return list(groups.values())


def _shared_prefix_attention(groups: list[tuple[Any, list[int]]], layer: int, q: torch.Tensor, own: torch.Tensor,
                             Vp: torch.Tensor, scale: float) -> torch.Tensor:
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


def decode_batch(model: Transformer, caches: list[SeqCache], tokens: list[int] | None, positions: list[int],
                 x: torch.Tensor | None = None, head: bool = True) -> torch.Tensor:
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
        x = model.embed(tokens.long() if torch.is_tensor(tokens) else
                        torch.tensor(tokens, dtype=torch.long, device=dev))
    pos = torch.tensor(positions, dtype=torch.long, device=dev)
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)  # [B, 1, D]
    rep, scale = H // KVH, D ** -0.5
    lmax = max(positions) + 1
    pad_mask = torch.arange(lmax, device=dev).view(1, lmax) > pos.view(B, 1)  # True: padding
    plain = all(isinstance(c, SeqCache) for c in caches)
    groups = _prefix_groups(caches) if plain and not a.windows and a.offload is None else []
    if groups:  # forked caches (shared_kv.py): the own segments start at their prefix's end
        base = torch.tensor([getattr(c, "base", 0) if getattr(c, "prefix", None) is not None else 0
                             for c in caches], dtype=torch.long, device=dev)
        lmax = int((pos - base).max()) + 1
        pad_mask = torch.arange(lmax, device=dev).view(1, lmax) > (pos - base).view(B, 1)
    for i, blk in enumerate(model.layers):
        if a.offload is not None and i == a.offload[0]:
            x, cos, sin, pad_mask = to_offload(a, x, cos, sin, pad_mask)
        attn = blk.self_attn
        q, k, v = project_qkv(attn, blk.input_layernorm(x), rows_linear)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
        Vp = torch.nn.utils.rnn.pad_sequence(vs, batch_first=True).transpose(1, 2)     # [B, KVH, Lmax, D]
        scores = torch.matmul(q.view(B, KVH, rep, D), K) * scale                      # [B, KVH, rep, Lmax]
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
    if not head:
        return x
    if a.offload is not None:
        x = from_offload(x, model.norm.weight)
    x = model.norm(x)
    w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return rows_linear(x, w)


def hf_state_to_ours(a: Args, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> this module's names (strip 'model.', stack experts).  Consumes ``sd``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, int], torch.Tensor] = {}
    for k in list(sd):  # pops: the caller's dict empties as ours fills (no second copy held)
        v = sd.pop(k)
        name = k[len("model."):] if k.startswith("model.") else k
        parts = name.split(".")
        if "experts" in parts and parts[0] == "layers":
            # layers.L.mlp.experts.E.gate_proj.weight  |  layers.L.block_sparse_moe.experts.E.w1.weight
            li, ei = int(parts[1]), int(parts[parts.index("experts") + 1])
            proj = parts[parts.index("experts") + 2]
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)
            experts[(li, proj, ei)] = v
            continue
        name = name.replace("block_sparse_moe.gate.", "mlp.gate.").replace("block_sparse_moe.", "mlp.")
        for proj, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            name = name.replace(f"mlp.switch_mlp.{proj}.weight", f"mlp.{ours}")  # stacked [E, out, in]
        out[name] = v
    for li in range(a.layers):
        for proj, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            if (li, proj, 0) in experts:
                out[f"layers.{li}.mlp.{ours}"] = torch.stack([experts[(li, proj, e)] for e in range(a.experts)])
    if a.tie:
        out.pop("lm_head.weight", None)
    return out


def build(config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
          expert_reader: Any = None, first_cpu_layer: int | None = None,
          offload_dtype: torch.dtype = torch.float32) -> Transformer:
    """``expert_reader`` (a swiftlm.experts.ExpertReader): MoE layers stream their experts."""
    a = Args.from_config(config)
    if not a.tie and not any(k.endswith("lm_head.weight") for k in state):
        a.tie = True  # an embedding-only checkpoint (e.g. Qwen3Model): no head; logits are never asked for
    with torch.device("meta"):
        model = Transformer(a) if a.ext is None else ext_model(a, first_cpu_layer, expert_reader)
        if expert_reader is not None:
            from .streamed_moe import StreamedMoE

            for i, layer in enumerate(model.layers):
                if i in expert_reader.layout.slabs:
                    layer.mlp = StreamedMoE(a, expert_reader, i, device, dtype)
    if a.arch in MOE_ARCHS:  # GPT-OSS's fused experts, DeepSeek's interleaved rope rows
        from .archs_moe import convert_state as moe_convert_state

        sd = moe_convert_state(a, state)
    else:
        sd = hf_state_to_ours(a, state)
    if a.ext is not None and a.arch not in MOE_ARCHS:  # Phi-3's fused projections, split
        from .archs import convert_state

        sd = convert_state(a, sd)
    if a.gemma:  # Gemma's RMSNorm multiplies by (1 + w): fold the 1 into the weights once
        sd = {k: (v.float() + 1.0 if k.endswith("norm.weight") else v) for k, v in sd.items()}
    # convert one tensor at a time, dropping the stored one: peak = the model + one tensor
    model.load_state_dict({k: sd.pop(k).to(dtype) for k in list(sd)}, strict=True, assign=True)
    model.init_rope()
    if first_cpu_layer is not None:  # --gpu-layers: layers [first_cpu_layer, L) stay on the CPU
        place(model, first_cpu_layer, device, offload_dtype)
    else:
        model.to(device)
    for layer in model.layers:
        if hasattr(layer.mlp, "to_device"):
            layer.mlp.to_device()
    return finish_load(model, dtype, eager=True)  # one process: runner.TorchModel picks the path


def ext_model(a: Args, first_cpu_layer: int | None, expert_reader: Any = None) -> Transformer:
    from .archs import ExtTransformer, refuse_flag

    if first_cpu_layer is not None:
        refuse_flag(a, "--gpu-layers")
    if expert_reader is not None:
        refuse_flag(a, "--stream-experts")
    if a.arch in MOE_ARCHS:
        from .archs_moe import MoeTransformer

        return MoeTransformer(a)
    return ExtTransformer(a)


def check_device(a: Args, device: torch.device, eager: bool = False) -> None:
    """On CUDA, archs.py's / archs_moe.py's architectures and live sliding windows run on the eager path
    only (``Args.eager_reason``): a single-process model picks it (``eager``: runner.TorchModel runs it
    so); tensor-parallel ranks and pipeline stages (which call ``finish_load`` without ``eager``) are
    refused.  Nothing is refused on the CPU."""
    why = a.eager_reason() if device.type == "cuda" and not eager else None
    if why is not None:
        from swiftlm.errors import UnsupportedArchitecture

        raise UnsupportedArchitecture(f"{why} runs on CUDA only in a single-process model (on the eager path), so "
                                      "serve it without --tensor-parallel and --pipeline-parallel")


def finish_load(model: "Transformer", dtype: torch.dtype, eager: bool = False) -> "Transformer":
    """The last steps of every load (one process, a tensor-parallel rank, a pipeline stage), once the
    weights are on their device: rope tables in the model's dtype (as HF), eval mode, fused projections.
    ``eager``: the caller can run the model on the eager path on CUDA (``check_device``)."""
    check_device(model.a, model.cos.device, eager)
    model.cos, model.sin = model.cos.to(dtype), model.sin.to(dtype)
    model.eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()
    return model


def param_bytes(model: Any) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in model.layers:  # fused weights are plain tensors, not parameters
        w, b = layer.self_attn.qkv
        n += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
        if hasattr(layer.mlp, "gate_up"):
            n += layer.mlp.gate_up.numel() * layer.mlp.gate_up.element_size()
    return n
