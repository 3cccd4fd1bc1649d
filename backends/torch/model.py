"""Decoder-only transformer for the llama family in plain torch (llama, mistral, qwen2, qwen3,
and the MoE variants qwen3_moe / qwen2_moe / mixtral), with this project's own KV cache.

Why our own model file and not transformers' modeling classes: a decode step here is a few
fused calls per layer on preallocated cache slices (no cache objects, masks or hooks rebuilt
per token), which is what makes small models fast on CPU and lets CUDA graphs capture a step.
Weights use HF names, so HF checkpoints load as they are.

This module holds the layers, the forward over a prompt chunk and the load (``build``); around it:
model_config.py (the config: ``Args``, the architectures, ``check_config``), rope.py (rope tables),
kv_cache.py (``SeqCache``), linear_rows.py (matmuls over a few rows, LoRA terms) and decode_rows.py
(``decode_batch``, the batched decode step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import SeqCache
from .linear_rows import linear_rows, lora_add, rows_linear
from .model_config import MOE_ARCHS, Args
from .offload import from_offload, place, to_offload
from .quant_linear import QuantLinear, QuantProj, cat_rows, weight_bytes
from .rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


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
        w = cat_rows([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]) if self.a.attn_bias else None
        self.qkv = (w, b)
        self.splits = (
            self.a.heads * self.a.head_dim,
            self.a.kv_heads * self.a.head_dim,
            self.a.kv_heads * self.a.head_dim,
        )
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SeqCache, layer: int, start: int
    ) -> torch.Tensor:
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
                raise NotImplementedError(
                    f"sliding_window={w} is not implemented for a compressed KV cache; "
                    "use the plain KV format for this model"
                )
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
            # One query row attends to everything so far: two small matmuls, cheaper on CPU than
            # the fused kernel's setup for a single query row.
            qg = q.reshape(a.kv_heads, rep, a.head_dim)
            scores = torch.matmul(qg, keys.transpose(1, 2)) * (a.head_dim**-0.5)  # [KVH, rep, S]
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            out = torch.matmul(probs, values).reshape(a.heads, 1, a.head_dim)
            return linear_rows(self.o_proj, out.transpose(0, 1).reshape(1, a.heads * a.head_dim))
        elif start == 0:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), is_causal=True, enable_gqa=rep > 1
            )
        else:  # a prefill chunk after earlier positions: causal within the chunk, full to the past
            out = chunk_attention(q, keys, values, start, rep)
        return linear_rows(self.o_proj, out[0].transpose(0, 1).reshape(T, a.heads * a.head_dim))


def chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, rep: int, window: int = 0
) -> torch.Tensor:
    """Attention of a prompt chunk at positions [start, start + T) over keys [0, start + T): causal
    within the chunk, full to the past.  On CUDA through a lower-right causal bias, which SDPA runs in
    its flash kernel; an explicit [T, S] mask would send every chunk of a long prompt to SDPA's slow
    masked kernel.  Returns [1, H, T, D].
    ``window``: each query sees only the last ``window`` keys up to itself (sliding-window attention)."""
    T, S = q.shape[1], keys.shape[1]
    if window:
        mask = window_mask(T, S, start, window, q.device)
    elif q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        mask: Any = causal_lower_right(T, S)
    else:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=rep > 1
    )


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
        self.gate_up = cat_rows([self.gate_proj.weight, self.up_proj.weight])
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

    def update_attend(
        self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0
    ) -> torch.Tensor:
        if window and max(self.lengths) > window:  # sliding window: one masked attention per sequence
            outs = [
                chunk_attention(qs, ks, vs, 0, q.shape[0] // k.shape[0], window=window)[0]
                for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))
            ]
            return torch.cat(outs, dim=1).transpose(0, 1).reshape(q.shape[1], -1)
        # one causal attention per sequence (a block-diagonal mask over the whole pack would cost
        # (sum T)^2 and leave SDPA's fused kernels for its slower masked fallback)
        gqa = q.shape[0] != k.shape[0]
        outs = [
            F.scaled_dot_product_attention(
                qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True, enable_gqa=gqa
            )[0]
            for qs, ks, vs in zip(q.split(self.lengths, 1), k.split(self.lengths, 1), v.split(self.lengths, 1))
        ]
        out = torch.cat(outs, dim=1)  # [H, T, D]
        return out.transpose(0, 1).reshape(q.shape[1], -1)


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
            x = x * torch.tensor(self.a.hidden**0.5, dtype=x.dtype)
        return x

    def hidden(self, tokens: torch.Tensor, kv: Any, start: int, last_only: bool = False) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] (or of the last position only).  With a
        ``PackedAttend`` as ``kv``: several sequences at once, each from position 0."""
        x = self.embed(tokens)
        T = tokens.shape[0]
        if isinstance(kv, PackedAttend):
            cos, sin = self.cos[kv.positions], self.sin[kv.positions]
        else:
            cos, sin = self.cos[start : start + T], self.sin[start : start + T]
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


def hf_state_to_ours(a: Args, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> this module's names (strip 'model.', stack experts).  Consumes ``sd``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, int], torch.Tensor] = {}
    for k in list(sd):  # pops: the caller's dict empties as ours fills (no second copy held)
        v = sd.pop(k)
        name = k[len("model.") :] if k.startswith("model.") else k
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


def build(
    config: dict,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    expert_reader: Any = None,
    first_cpu_layer: int | None = None,
    offload_dtype: torch.dtype = torch.float32,
) -> Transformer:
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
    quant = {k: sd.pop(k) for k in [k for k, v in sd.items() if isinstance(v, QuantLinear)]}
    if quant and (a.ext is not None or a.experts or first_cpu_layer is not None):  # no kernels there: 16-bit
        sd.update({k: q.dequantized(dtype) for k, q in quant.items()})
        quant = {}
    # convert one tensor at a time, dropping the stored one: peak = the model + one tensor
    missing, unexpected = model.load_state_dict(
        {k: sd.pop(k).to(dtype) for k in list(sd)}, strict=not quant, assign=True
    )
    if quant:
        install_quantized(model, quant, missing, unexpected, device, dtype)
    model.init_rope()
    if first_cpu_layer is not None:  # --gpu-layers: layers [first_cpu_layer, L) stay on the CPU
        place(model, first_cpu_layer, device, offload_dtype)
    else:
        model.to(device)
    for layer in model.layers:
        if hasattr(layer.mlp, "to_device"):
            layer.mlp.to_device()
    return finish_load(model, dtype, eager=True)  # one process: runner.TorchModel picks the path


def install_quantized(
    model: nn.Module,
    quant: dict[str, QuantLinear],
    missing: list[str],
    unexpected: list[str],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Each quantized weight's ``nn.Linear`` replaced by a ``QuantProj`` on ``device`` (its bias kept)."""
    if unexpected or set(missing) != set(quant):
        extra = sorted(unexpected) or sorted(set(missing) ^ set(quant))
        raise RuntimeError(f"quantized state does not match the model: {extra[:3]}")
    for name, q in quant.items():
        path = name[: -len(".weight")]
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent)
        lin = getattr(owner, attr)
        bias = lin.bias if isinstance(lin, nn.Linear) and lin.bias is not None else None
        setattr(owner, attr, QuantProj(q.with_dtype(dtype).to(device), bias))


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

        raise UnsupportedArchitecture(
            f"{why} runs on CUDA only in a single-process model (on the eager path), so "
            "serve it without --tensor-parallel and --pipeline-parallel"
        )


def finish_load(model: Transformer, dtype: torch.dtype, eager: bool = False) -> Transformer:
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
        n += weight_bytes(w) + weight_bytes(b)
        if hasattr(layer.mlp, "gate_up"):
            n += weight_bytes(layer.mlp.gate_up)
    n += sum(weight_bytes(m.weight) for m in model.modules() if isinstance(m, QuantProj))
    return n
