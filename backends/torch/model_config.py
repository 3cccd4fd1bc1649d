"""What a checkpoint's config.json means to the torch backend's native layers: the architectures it
runs (``SUPPORTED``; ``EXTRA_ARCHS``: archs.py, ``MOE_ARCHS``: archs_moe.py), the model dimensions
(``Args``), the per-layer sliding windows, and the refusal of any config field that changes the
computation and is not implemented (``check_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swiftlm.errors import UnsupportedArchitecture

from . import archs_config, moe_config
from .rope import ROPE_TYPES, rope_params, rope_type

SUPPORTED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "smollm3",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
)
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
    ext: Any = None  # archs_config.Ext / moe_config.MoeExt: what an EXTRA_ARCHS / MOE_ARCHS architecture changes

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def eager_reason(self, ctx: int | None = None) -> str | None:
        """Why this model runs on the eager path on CUDA (per-sequence caches and eager forwards, no slot
        pool, CUDA graphs, packed prefill or paged attention: those run the llama-family layer over every
        key), or None.  ``ctx``: the served context; a window no shorter than it changes nothing."""
        if self.ext is not None:
            feature = (moe_config if self.arch in MOE_ARCHS else archs_config).cuda_feature(self)
            return f"architecture {self.arch!r} ({feature})"
        live = [w for w in self.windows if w and (ctx is None or w < ctx)]
        return f"config field sliding_window={max(live)}" if live else None

    @property
    def needs_eager(self) -> bool:
        """On CUDA this model runs eagerly (``eager_reason``): no slot pool, CUDA graphs or paged attention."""
        return self.eager_reason() is not None

    @classmethod
    def from_config(cls, c: dict) -> Args:
        arch = c["model_type"]
        heads = c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        check_config(c)
        rs = rope_params(c)
        ctx = c.get("max_position_embeddings", 4096)
        if rope_type(rs) == "yarn" and rs.get("factor") and rs.get("original_max_position_embeddings"):
            ctx = max(ctx, int(rs["original_max_position_embeddings"] * rs["factor"]))  # YaRN's extended context
        a = cls(
            arch=arch,
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c.get("intermediate_size", 0),
            vocab=c["vocab_size"],
            eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0,
            ctx=ctx,
            tie=c.get("tie_word_embeddings", False),
            attn_bias=c.get("attention_bias", arch in ("qwen2", "qwen2_moe")),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            experts=experts,
            top_k=c.get("num_experts_per_tok", 0),
            moe_intermediate=c.get("moe_intermediate_size") or c.get("intermediate_size", 0),
            norm_topk=c.get("norm_topk_prob", arch == "mixtral"),
            shared_intermediate=c.get("shared_expert_intermediate_size", 0),
            rope_scaling=rs,
            gemma=arch in ("gemma", "gemma2", "gemma3_text"),
            windows=sliding_windows(c, ctx),
            ext=extension(c),
        )
        if arch in MOE_ARCHS:  # fields under other names; MLA's latent cache layout
            moe_config.adjust_args(a, c)
        return a


def extension(c: dict) -> Any:
    """archs_config.settings / moe_config.settings for the architectures they add (None for the llama family)."""
    if c["model_type"] in MOE_ARCHS:
        return moe_config.settings(c)
    return archs_config.settings(c) if c["model_type"] in EXTRA_ARCHS else None


def sliding_windows(c: dict, ctx: int) -> tuple:
    """Per-layer sliding-window widths as transformers applies them (0: full attention).  Mistral,
    Mixtral and Qwen3-MoE slide every layer; Qwen2/Qwen3/Qwen2-MoE slide the layers ``layer_types``
    names (derived from ``use_sliding_window`` and ``max_window_layers`` when absent).  Llama and
    Gemma(1) have no sliding window.  A window no shorter than the context changes nothing."""
    arch, n, w = c["model_type"], c["num_hidden_layers"], c.get("sliding_window")
    if arch in EXTRA_ARCHS:
        return archs_config.layer_windows(c, ctx)
    if arch in MOE_ARCHS:
        return moe_config.layer_windows(c, ctx)
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not c.get("use_sliding_window", False):
        w = None
    if not w or arch in ("llama", "gemma"):
        return ()
    if arch in ("mistral", "mixtral", "qwen3_moe"):
        kinds = ["sliding_attention"] * n
    else:
        kinds = c.get("layer_types") or [
            "sliding_attention" if i >= c.get("max_window_layers", 28) else "full_attention" for i in range(n)
        ]
    out = tuple(int(w) if k == "sliding_attention" and int(w) < ctx else 0 for k in kinds)
    return out if any(out) else ()


def check_config(c: dict) -> None:
    """Refuse, in one sentence naming the field and its value, any config field that changes the
    computation and that this model file does not implement (nothing is dropped silently)."""

    def refuse(field: str, value: Any) -> None:
        raise UnsupportedArchitecture(
            f"config field {field}={value!r} ({c['model_type']}) is not implemented by the torch backend's native path"
        )

    if c["model_type"] in EXTRA_ARCHS:  # archs_config.py refuses its own and takes out the fields it implements
        c = archs_config.check_fields(c, refuse)
    if c["model_type"] in MOE_ARCHS:  # as archs_config.py, for archs_moe.py's (moe_config.py)
        c = moe_config.check_fields(c, refuse)
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
    for field in (
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "logit_scale",
        "query_pre_attn_scalar",
        "attention_multiplier",
        "embedding_multiplier",
        "residual_multiplier",
        "logits_scaling",
    ):
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
