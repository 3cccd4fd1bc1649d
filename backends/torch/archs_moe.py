"""GPT-OSS and DeepSeek-V2 / V3 (multi-head latent attention), native in the torch backend.  model.py
keeps the llama-family layer and archs.py the dense architectures added before; this module adds the
math these three change, on the same weights-by-HF-name, ``SeqCache`` and ``PackedAttend`` (what they
read from a config.json: moe_config.py):

- GPT-OSS (``gpt_oss``): attention sinks (a learned logit per head in the softmax denominator, its
  column dropped after the softmax), q/k/v/o projections with biases, alternating sliding-window /
  full layers (``layer_types``), YaRN rope, and a top-k MoE whose router has a bias, whose experts
  have biases and apply the clamped SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
  with ``g = clamp(gate, max=limit)``; the routing weights are a softmax over the top-k logits.
- DeepSeek-V2 / V3 (``deepseek_v2``, ``deepseek_v3``): multi-head latent attention -- queries through
  ``q_lora_rank`` (``q_a_proj``, norm, ``q_b_proj``) or one ``q_proj``; keys and values from a latent of
  ``kv_lora_rank`` (normed) expanded by ``kv_b_proj`` into per-head nope keys and values, plus one rope
  key shared by all heads (``qk_rope_head_dim``, DeepSeek's interleaved pairs de-interleaved at load);
  YaRN rope with ``mscale`` / ``mscale_all_dim`` as transformers applies them (table factor
  mscale/mscale_all_dim, attention scale times mscale_all_dim's factor squared); dense MLP layers before
  ``first_k_dense_replace``, then routed experts plus shared experts.  Routing: V2 softmax scores,
  ``greedy`` or ``group_limited_greedy`` (best expert per group), times ``routed_scaling_factor``; V3
  sigmoid scores, top-k chosen on scores + ``e_score_correction_bias`` among the ``topk_group`` groups
  with the best two-expert sums (``n_group``), weights the un-biased scores, normalized
  (``norm_topk_prob``) and times ``routed_scaling_factor``.

The KV cache of an MLA layer is the latent, not per-head keys and values: per position the normed
latent (kv_lora_rank) and the rotated shared rope key (qk_rope_head_dim), the vector split across the
``SeqCache``'s k and v rows (``Args.kv_heads`` = 1, ``Args.head_dim`` = half the vector, rounded up), so
``kv_bytes_per_token`` is the latent's size (DeepSeek-V3: 576 values per layer against 2 x 128 x 192
for full keys and values).  A decode row attends in the latent space (queries through ``kv_b_proj``'s
key half, the output through its value half: the "absorbed" form); a prompt chunk expands the latent
into per-head keys and values for its attention.

On CUDA these architectures run on the eager path (``model_config.Args.eager_reason``, runner.TorchModel's
``static`` off): per-sequence caches and eager forwards, since the CUDA graphs, slot pool prefill and paged
attention run the llama-family layer (no sinks, no latent attention).  Softmaxes and routing scores stay
in fp32 in bf16 models (transformers keeps DeepSeek's routing in fp32; it runs GPT-OSS's sink softmax and
router softmax in the model's dtype, so bf16 runs may differ from it by rounding there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .archs import CoreTransformer
from .forward import mlp_rows, project_qkv
from .linear_rows import rows_linear
from .model import MLP, RMSNorm, causal_mask
from .rope import apply_rope, rope_tables

LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


def _deinterleave(n: int) -> torch.Tensor:
    """Index order [0, 2, 4, ..., 1, 3, 5, ...]: DeepSeek's rope pairs (x0, x1), (x2, x3), ... as rotate-half halves."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def convert_state(a: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> this module's (strip 'model.', experts stacked as [E, out, in], GPT-OSS's
    interleaved gate/up columns split, DeepSeek's rope rows de-interleaved).  Consumes ``state``; layers at
    or past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer) are dropped, as transformers does."""
    e = a.ext
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, int], torch.Tensor] = {}
    for k in list(state):
        v = state.pop(k)
        name = k[len("model.") :] if k.startswith("model.") else k
        parts = name.split(".")
        if name.endswith("rotary_emb.inv_freq") or (parts[0] == "layers" and int(parts[1]) >= a.layers):
            continue
        if parts[0] == "layers" and "experts" in parts:
            li, rest = int(parts[1]), parts[parts.index("experts") + 1 :]
            p = f"layers.{li}.mlp."
            if rest[0].isdigit():  # experts.E.gate_proj.weight
                experts[(li, rest[1], int(rest[0]))] = v
            elif a.arch == "gpt_oss" and rest[0] == "gate_up_proj":  # [E, H, 2I], gate / up interleaved columns
                out[p + "w_gate"], out[p + "w_up"] = v[..., ::2].transpose(1, 2), v[..., 1::2].transpose(1, 2)
            elif a.arch == "gpt_oss" and rest[0] == "gate_up_proj_bias":
                out[p + "b_gate"], out[p + "b_up"] = v[..., ::2], v[..., 1::2]
            elif a.arch == "gpt_oss" and rest[0] == "down_proj":  # [E, I, H]
                out[p + "w_down"] = v.transpose(1, 2)
            elif a.arch == "gpt_oss" and rest[0] == "down_proj_bias":
                out[p + "b_down"] = v
            elif rest[0] == "gate_up_proj":  # transformers 5's fused [E, 2I, H]
                out[p + "w_gate"], out[p + "w_up"] = v.chunk(2, dim=1)
            elif rest[0] == "down_proj":
                out[p + "w_down"] = v
            else:
                out[name] = v  # unknown: load_state_dict(strict=True) names it
            continue
        out[name] = v
    for li, proj, _ in sorted({(li, proj, 0) for li, proj, _ in experts}):
        ours = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}[proj]
        out[f"layers.{li}.mlp.{ours}"] = torch.stack([experts.pop((li, proj, j)) for j in range(a.experts)])
    if e.kind == "mla" and e.interleave:
        perm = _deinterleave(e.rot_dim)
        qk = e.nope + e.rot_dim
        for li in range(a.layers):
            p = f"layers.{li}.self_attn."
            qn = p + ("q_b_proj.weight" if e.q_lora else "q_proj.weight")
            w = out[qn].view(a.heads, qk, -1)
            out[qn] = torch.cat([w[:, : e.nope], w[:, e.nope :][:, perm]], dim=1).reshape(a.heads * qk, -1)
            for kn in (p + "kv_a_proj_with_mqa.weight", p + "kv_a_proj_with_mqa.bias"):
                if kn in out:
                    t = out[kn]
                    out[kn] = torch.cat([t[: e.kv_lora], t[e.kv_lora :][perm]])
    if a.tie:
        out.pop("lm_head.weight", None)
    return out


# --- attention ---------------------------------------------------------------------------------------------


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [H, T, D] at positions [start, start + T) over keys/values [KVH, start + T, D] -> [T, H*D]: causal
    (the last ``window`` keys where a window applies), each head's sink logit one more column of its
    softmax, dropped after it (so the head's weights sum to less than one)."""
    H, T, D = q.shape
    KVH, S = keys.shape[0], keys.shape[1]
    rep = H // KVH
    mask = None
    if T == 1 and window and S > window:
        keys, values, S = keys[:, -window:], values[:, -window:], window
    elif T > 1:  # a window layer may have dropped its oldest rows (kv_cache.SeqCache): the chunk starts at row S - T
        mask = causal_mask(T, S, S - T, window, q.device)
    scores = (torch.matmul(q.reshape(KVH, rep * T, D), keys.transpose(1, 2)) * scale).float().view(KVH, rep, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(KVH, rep, 1, 1).expand(KVH, rep, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S].to(values.dtype)
    out = torch.matmul(probs.reshape(KVH, rep * T, S), values).view(H, T, D)
    return out.transpose(0, 1).reshape(T, H * D)


class SinkAttention(nn.Module):
    """GPT-OSS attention: q/k/v/o with biases, a sink logit per head."""

    def __init__(self, a: Any):
        super().__init__()
        self.a = a
        b = a.attn_bias
        self.q_proj = nn.Linear(a.hidden, a.heads * a.head_dim, bias=b)
        self.k_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=b)
        self.v_proj = nn.Linear(a.hidden, a.kv_heads * a.head_dim, bias=b)
        self.o_proj = nn.Linear(a.heads * a.head_dim, a.hidden, bias=b)
        self.sinks = nn.Parameter(torch.empty(a.heads))

    def fuse(self) -> None:
        a = self.a
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) if a.attn_bias else None
        self.qkv = (w, b)
        self.splits = (a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, H, D], k / v [n, KVH, D] (rotated) for n rows."""
        q, k, v = project_qkv(self, x, rows_linear)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def core(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int) -> torch.Tensor:
        return sink_attention(q, keys, values, start, window, self.sinks, self.a.ext.scale)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return rows_linear(o, self.o_proj.weight, self.o_proj.bias)


class LatentAttention(nn.Module):
    """DeepSeek multi-head latent attention over a latent KV cache (see the module docstring)."""

    def __init__(self, a: Any):
        super().__init__()
        self.a = a
        e, H, b = a.ext, a.heads, a.attn_bias
        qk = e.nope + e.rot_dim
        if e.q_lora:
            self.q_a_proj = nn.Linear(a.hidden, e.q_lora, bias=b)
            self.q_a_layernorm = RMSNorm(e.q_lora, LATENT_EPS)
            self.q_b_proj = nn.Linear(e.q_lora, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(a.hidden, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden, e.kv_lora + e.rot_dim, bias=b)
        self.kv_a_layernorm = RMSNorm(e.kv_lora, LATENT_EPS)
        self.kv_b_proj = nn.Linear(e.kv_lora, H * (e.nope + e.v_dim), bias=False)
        self.o_proj = nn.Linear(H * e.v_dim, a.hidden, bias=b)

    def fuse(self) -> None:
        """One matmul for the query's first projection and the latent's ([q_a | kv_a] or [q | kv_a])."""
        first = self.q_a_proj if self.a.ext.q_lora else self.q_proj
        kv = self.kv_a_proj_with_mqa
        w = torch.cat([first.weight, kv.weight])
        b = None
        if kv.bias is not None:
            b = torch.cat([first.bias if first.bias is not None else kv.bias.new_zeros(first.out_features), kv.bias])
        self.qkv = (w, b)
        self.splits = (first.out_features, kv.out_features)
        if self.a.ext.q_lora:
            del self.q_a_proj
        else:
            del self.q_proj
        del self.kv_a_proj_with_mqa
        wkv = self.kv_b_proj.weight.view(self.a.heads, self.a.ext.nope + self.a.ext.v_dim, self.a.ext.kv_lora)
        self.w_uk, self.w_uv = wkv[:, : self.a.ext.nope], wkv[:, self.a.ext.nope :]  # [H, nope, r], [H, v, r]

    def project(self, x: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, H, nope + rope] (rope part rotated); the cache rows: [normed latent | rotated rope key],
        split in two halves k / v [n, 1, Args.head_dim]."""
        a, e, n = self.a, self.a.ext, x.shape[0]
        qa, ckv = rows_linear(x, *self.qkv).split(self.splits, dim=-1)
        q = rows_linear(self.q_a_layernorm(qa), self.q_b_proj.weight) if e.q_lora else qa
        q = q.view(n, a.heads, e.nope + e.rot_dim)
        cos, sin = rope
        q = torch.cat([q[..., : e.nope], apply_rope(q[..., e.nope :], cos, sin)], dim=-1)
        latent = self.kv_a_layernorm(ckv[:, : e.kv_lora])
        k_rot = apply_rope(ckv[:, e.kv_lora :], cos[:, 0], sin[:, 0])
        row = torch.cat([latent, k_rot], dim=-1)
        pad = 2 * a.head_dim - row.shape[-1]
        if pad:
            row = F.pad(row, (0, pad))
        k, v = row.view(n, 1, 2 * a.head_dim).split(a.head_dim, dim=-1)
        return q, k, v

    def core(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int) -> torch.Tensor:
        """q [H, T, nope + rope] at positions [start, start + T) over the cache rows [1, start + T, head_dim]
        (twice) -> [T, H * v_head_dim]."""
        e = self.a.ext
        H, T, _ = q.shape
        rows = torch.cat([keys[0], values[0]], dim=-1)
        S = rows.shape[0]
        c, k_rot = rows[:, : e.kv_lora], rows[:, e.kv_lora : e.kv_lora + e.rot_dim]
        q_nope, q_rot = q[..., : e.nope], q[..., e.nope :]
        if T == 1:  # decode: attention in the latent space (no per-head keys or values built)
            q_lat = torch.matmul(q_nope, self.w_uk)  # [H, 1, r]
            scores = (torch.matmul(q_lat, c.t()) + torch.matmul(q_rot, k_rot.t())) * e.scale  # [H, 1, S]
            probs = torch.softmax(scores.float(), dim=-1).to(c.dtype)
            out = torch.matmul(torch.matmul(probs, c), self.w_uv.transpose(1, 2))  # [H, 1, v]
        else:  # a prompt chunk: the latent expanded into per-head keys and values
            kv = rows_linear(c, self.kv_b_proj.weight).view(S, H, e.nope + e.v_dim).transpose(0, 1)
            k = torch.cat([kv[..., : e.nope], k_rot.unsqueeze(0).expand(H, S, e.rot_dim)], dim=-1)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0),
                k.unsqueeze(0),
                kv[..., e.nope :].unsqueeze(0),
                attn_mask=causal_mask(T, S, start, 0, q.device),
                scale=e.scale,
            )[0]
        return out.transpose(0, 1).reshape(T, H * e.v_dim)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return rows_linear(o, self.o_proj.weight, self.o_proj.bias)


# --- experts ---------------------------------------------------------------------------------------------


def _expert_mix(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, expert: Callable) -> torch.Tensor:
    """sum over each row's top-k experts of weight x expert(row); ``expert(e, rows)`` -> outputs."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, expert(e, x[rows]) * w[rows, slot].unsqueeze(-1).to(x.dtype))
    return out


class GptOssMoE(nn.Module):
    """Router with a bias, softmax over the top-k logits; experts with biases and the clamped SwiGLU."""

    def __init__(self, a: Any):
        super().__init__()
        E, H, I = a.experts, a.hidden, a.moe_intermediate
        self.a = a
        self.router = nn.Linear(H, E, bias=True)
        self.w_gate, self.w_up = nn.Parameter(torch.empty(E, I, H)), nn.Parameter(torch.empty(E, I, H))
        self.b_gate, self.b_up = nn.Parameter(torch.empty(E, I)), nn.Parameter(torch.empty(E, I))
        self.w_down, self.b_down = nn.Parameter(torch.empty(E, H, I)), nn.Parameter(torch.empty(E, H))

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        x = self.a.ext
        g = (h @ self.w_gate[e].t() + self.b_gate[e]).clamp(max=x.limit)
        u = (h @ self.w_up[e].t() + self.b_up[e]).clamp(-x.limit, x.limit)
        return ((u + 1) * g * torch.sigmoid(g * x.alpha)) @ self.w_down[e].t() + self.b_down[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = rows_linear(x, self.router.weight, self.router.bias)
        top, idx = torch.topk(logits, self.a.top_k, dim=-1)
        return _expert_mix(x, torch.softmax(top.float(), dim=-1), idx, self.expert)


class Router(nn.Module):
    def __init__(self, a: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(a.experts, a.hidden))
        if a.ext.routing == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(a.experts))


class DeepseekMoE(nn.Module):
    """Routed experts (SiLU GLU) chosen as DeepSeek-V2 / V3 route, plus the shared experts."""

    def __init__(self, a: Any):
        super().__init__()
        E, H, I = a.experts, a.hidden, a.moe_intermediate
        self.a = a
        self.gate = Router(a)
        self.w_gate, self.w_up = nn.Parameter(torch.empty(E, I, H)), nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        self.shared_experts = MLP(H, a.ext.shared_inter) if a.ext.shared_inter else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k] fp32, expert ids [n, k]); scores in fp32, as transformers."""
        e, E, k = self.a.ext, self.a.experts, self.a.top_k
        n, G = x.shape[0], e.n_group
        logits = F.linear(x.float(), self.gate.weight.float())
        if e.routing == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias.float()
            group = choice.view(n, G, E // G).topk(2, dim=-1).values.sum(-1)
        else:
            scores = choice = logits.softmax(dim=-1)
            group = scores.view(n, G, E // G).amax(dim=-1)
        if G > 1:
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(e.topk_group, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand(n, G, E // G).reshape(n, E)
            choice = choice.masked_fill(~keep, float("-inf") if e.routing == "noaux_tc" else 0.0)
        idx = choice.topk(k, dim=-1).indices
        w = scores.gather(1, idx)
        if e.norm_topk and e.routing == "noaux_tc":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * e.routed_scale, idx

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return (F.silu(h @ self.w_gate[e].t()) * (h @ self.w_up[e].t())) @ self.w_down[e].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(x)
        out = _expert_mix(x, w, idx, self.expert)
        return out if self.shared_experts is None else out + mlp_rows(self.shared_experts, x)


# --- the model -------------------------------------------------------------------------------------------


class MoeBlock(nn.Module):
    def __init__(self, a: Any, layer: int):
        super().__init__()
        e = a.ext
        self.layer = layer
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)
        if e.kind == "gpt_oss":
            self.self_attn: nn.Module = SinkAttention(a)
            self.mlp: nn.Module = GptOssMoE(a)
        else:
            self.self_attn = LatentAttention(a)
            self.mlp = MLP(a.hidden, a.intermediate) if layer < e.first_dense else DeepseekMoE(a)

    def forward(self, x: torch.Tensor, rope: tuple, attend: Callable) -> torch.Tensor:
        q, k, v = self.self_attn.project(self.input_layernorm(x), rope)
        x = x + self.self_attn.out(attend(self.layer, q, k, v))
        return x + mlp_rows(self.mlp, self.post_attention_layernorm(x))


class MoeTransformer(CoreTransformer):
    """``archs.CoreTransformer`` with this module's layers (one rope table for all of them)."""

    def __init__(self, a: Any):
        super().__init__(a)
        self.layers = nn.ModuleList(MoeBlock(a, i) for i in range(a.layers))

    def init_rope(self) -> None:
        e = self.a.ext
        self.cos, self.sin = rope_tables(
            replace(self.a, rope_theta=e.rope_theta, rope_scaling=e.rope, head_dim=e.rot_dim),
            self.embed_tokens.weight.device,
        )

    def _ropes(self, pos: torch.Tensor, last: torch.Tensor, dtype: torch.dtype) -> list:
        rope = self.cos[pos].to(dtype).unsqueeze(1), self.sin[pos].to(dtype).unsqueeze(1)  # [n, 1, rot]
        return [rope] * len(self.layers)

    def _core(self, layer: int) -> Callable:
        return self.layers[layer].self_attn.core
