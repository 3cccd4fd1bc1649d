"""What the architectures of archs_moe.py (GPT-OSS, DeepSeek-V2 / V3) read from a config.json: the fields
they implement or refuse (``check_fields``), what they change (``settings``: ``Args.ext``), the Args fields
they name differently (``adjust_args``), their sliding windows, and why they run on the eager path on CUDA.
Imports only rope.py, so model_config.py can read a config without the layers."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .rope import rope_params, rope_type

MLA = ("deepseek_v2", "deepseek_v3")
# config classes' defaults, for fields a config.json may leave out
DEEPSEEK_DEFAULTS = {
    "deepseek_v2": {
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "n_group": None,
        "topk_group": None,
        "topk_method": "greedy",
        "n_routed_experts": 64,
    },
    "deepseek_v3": {
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "n_routed_experts": 256,
    },
}


def _get(c: dict, field: str) -> Any:
    return c[field] if field in c else DEEPSEEK_DEFAULTS[c["model_type"]][field]


@dataclass
class MoeExt:
    """What an architecture of archs_moe.py changes (``Args.ext``)."""

    kind: str  # "gpt_oss" or "mla"
    scale: float  # attention score scale
    rope_theta: float
    rope: dict | None  # the rope table's scaling (yarn with factor and attention_factor resolved) or None
    rot_dim: int  # rotary dimensions (head_dim; MLA: qk_rope_head_dim)
    alpha: float = 1.702  # GPT-OSS clamped SwiGLU
    limit: float = 7.0
    q_lora: int | None = None  # MLA
    kv_lora: int = 0
    nope: int = 0
    v_dim: int = 0
    interleave: bool = False  # DeepSeek's interleaved rope pairs (de-interleaved at load)
    routing: str = "gpt_oss"  # gpt_oss | greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    norm_topk: bool = False
    first_dense: int = 0
    shared_inter: int = 0


def _yarn(c: dict, rs: dict, refuse: Callable[[str, Any], None] | None = None) -> dict:
    """The yarn dict rope.rope_tables reads, with ``factor`` and ``attention_factor`` resolved as transformers'
    ``_compute_yarn_parameters`` does (factor absent: max_position_embeddings / original; attention factor
    mscale / mscale_all_dim when both are set, else 0.1 ln(factor) + 1)."""
    orig = rs.get("original_max_position_embeddings")
    if not orig:
        if refuse is not None:
            refuse("rope_scaling.original_max_position_embeddings", orig)
        orig = c.get("max_position_embeddings", 4096)
    factor = rs.get("factor") or c.get("max_position_embeddings", orig) / orig

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    att = rs.get("attention_factor")
    if att is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": orig,
        "attention_factor": att,
        "beta_fast": rs.get("beta_fast") or 32,
        "beta_slow": rs.get("beta_slow") or 1,
        "truncate": rs.get("truncate", True),
    }


def check_fields(c: dict, refuse: Callable[[str, Any], None]) -> dict:
    """Refuse what these architectures do not implement (one sentence naming field and value), and
    return ``c`` less the fields implemented here, for model_config.check_config's generic checks."""
    arch = c["model_type"]
    c = dict(c)
    qc = c.get("quantization_config")
    if qc:
        refuse("quantization_config.quant_method", qc.get("quant_method") if isinstance(qc, dict) else qc)
    rs = rope_params(c) or {}
    if rope_type(rs) not in ("default", "yarn"):
        refuse("rope_scaling.rope_type", rope_type(rs))
    if rope_type(rs) == "yarn":
        _yarn(c, rs, refuse)
    c.pop("rope_scaling", None)
    c.pop("rope_parameters", None)
    if arch == "gpt_oss":
        c.pop("hidden_act", None)  # the experts apply the clamped SwiGLU whatever it says (as transformers)
        for f in ("swiglu_limit", "swiglu_alpha"):
            if f in c and not (isinstance(c[f], (int, float)) and c[f] > 0):
                refuse(f, c[f])
        return c
    E = _get(c, "n_routed_experts")
    if not E:
        refuse("n_routed_experts", E)
    if c.get("num_key_value_heads") not in (None, c["num_attention_heads"]):
        refuse("num_key_value_heads", c["num_key_value_heads"])
    if c.get("moe_layer_freq", 1) != 1:  # the original code's; transformers has no such field
        refuse("moe_layer_freq", c["moe_layer_freq"])
    method = _get(c, "topk_method")
    if arch == "deepseek_v2":
        if method not in ("greedy", "group_limited_greedy"):
            refuse("topk_method", method)
        if c.get("scoring_func", "softmax") != "softmax":
            refuse("scoring_func", c["scoring_func"])
        if _get(c, "norm_topk_prob"):  # the original normalizes, transformers' DeepseekV2 does not: ambiguous
            refuse("norm_topk_prob", c["norm_topk_prob"])
    else:
        if c.get("topk_method", "noaux_tc") != "noaux_tc":
            refuse("topk_method", c["topk_method"])
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            refuse("scoring_func", c["scoring_func"])
    if arch == "deepseek_v3" or method == "group_limited_greedy":
        G, TG = _get(c, "n_group") or 1, _get(c, "topk_group") or 1
        if E % G or (arch == "deepseek_v3" and E // G < 2):
            refuse("n_group", G)
        if not 1 <= TG <= G:
            refuse("topk_group", TG)
    if rope_type(rs) == "yarn" and (_get(c, "qk_rope_head_dim") % 2):
        refuse("qk_rope_head_dim", c["qk_rope_head_dim"])
    return c


def settings(c: dict) -> MoeExt:
    """``Args.ext`` for an architecture of archs_moe.py (the config already passed ``check_fields``)."""
    arch = c["model_type"]
    rs = rope_params(c) or {}
    theta = c.get("rope_theta") or rs.get("rope_theta") or (150000.0 if arch == "gpt_oss" else 10000.0)
    rope = _yarn(c, rs) if rope_type(rs) == "yarn" else None
    if arch == "gpt_oss":
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return MoeExt(
            kind="gpt_oss",
            scale=head_dim**-0.5,
            rope_theta=theta,
            rope=rope,
            rot_dim=head_dim,
            alpha=float(c.get("swiglu_alpha", 1.702)),
            limit=float(c.get("swiglu_limit", 7.0)),
        )
    nope, rot = _get(c, "qk_nope_head_dim"), _get(c, "qk_rope_head_dim")
    scale = (nope + rot) ** -0.5
    if rope is not None and rs.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        m = 0.1 * rs["mscale_all_dim"] * math.log(rope["factor"]) + 1.0 if rope["factor"] > 1 else 1.0
        scale = scale * m * m
    method = _get(c, "topk_method") if arch == "deepseek_v2" else "noaux_tc"
    grouped = method != "greedy"
    return MoeExt(
        kind="mla",
        scale=scale,
        rope_theta=theta,
        rope=rope,
        rot_dim=rot,
        q_lora=_get(c, "q_lora_rank"),
        kv_lora=_get(c, "kv_lora_rank"),
        nope=nope,
        v_dim=_get(c, "v_head_dim"),
        interleave=arch == "deepseek_v2" or bool(c.get("rope_interleave", True)),
        routing=method,
        n_group=(_get(c, "n_group") or 1) if grouped else 1,
        topk_group=(_get(c, "topk_group") or 1) if grouped else 1,
        routed_scale=float(_get(c, "routed_scaling_factor")),
        norm_topk=bool(_get(c, "norm_topk_prob")),
        first_dense=int(_get(c, "first_k_dense_replace") or 0),
        shared_inter=(c.get("moe_intermediate_size") or 1407) * int(_get(c, "n_shared_experts") or 0),
    )


def adjust_args(a: Any, c: dict) -> None:
    """The Args fields model_config.Args.from_config reads under other names for these architectures; MLA's cache
    layout (the latent vector split across one k row and one v row)."""
    e = a.ext
    if a.arch == "gpt_oss":
        a.attn_bias = bool(c.get("attention_bias", True))  # GptOssConfig's default
        a.moe_intermediate = c["intermediate_size"]
        return
    a.attn_bias = bool(c.get("attention_bias", False))
    a.experts = _get(c, "n_routed_experts")
    a.top_k = c.get("num_experts_per_tok") or a.top_k
    a.moe_intermediate = c.get("moe_intermediate_size") or 1407
    a.norm_topk = e.norm_topk
    a.kv_heads, a.head_dim = 1, -(-(e.kv_lora + e.rot_dim) // 2)


def layer_windows(c: dict, ctx: int) -> tuple:
    """Per-layer sliding-window widths (0: full attention): GPT-OSS's sliding layers; none for DeepSeek."""
    if c["model_type"] != "gpt_oss":
        return ()
    w = c.get("sliding_window", 128)
    n = c["num_hidden_layers"]
    kinds = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    out = tuple(int(w) if w and k == "sliding_attention" and int(w) < ctx else 0 for k in kinds)
    return out if any(out) else ()


def cuda_feature(a: Any) -> str:
    """The feature that keeps this architecture off the CUDA fast path (named in the load log)."""
    return "attention sinks" if a.arch == "gpt_oss" else "multi-head latent attention"
