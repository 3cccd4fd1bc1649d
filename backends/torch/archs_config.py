"""What the architectures of archs.py (Gemma 2, Gemma 3 text, Phi-3 / Phi-4, OLMo 2, SmolLM3) read from a
config.json: the fields they implement or refuse (``check_fields``), what they change (``settings``:
``Args.ext``), their sliding windows, and why they run on the eager path on CUDA.  Imports only rope.py, so
model_config.py can read a config without the layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swiftlm.errors import ConfigError

from .rope import rope_params, rope_type

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
    """What an architecture of archs.py changes (``Args.ext``)."""

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
    """``Args.ext`` for an architecture of archs.py (the config already passed ``check_fields``)."""
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
        raise ConfigError(
            f"{flag} is not available for architecture {a.arch!r}, whose layer the torch backend "
            "runs on a single process only; serve this model without it"
        )
