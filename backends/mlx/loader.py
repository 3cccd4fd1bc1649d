"""Loading weights into mlx-lm model classes: HF directories and llama-family GGUF."""

from __future__ import annotations

import logging
import pkgutil
import re
from functools import cache, lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from swiftlm.errors import CorruptModel, UnsupportedArchitecture
from swiftlm.registry import ModelSpec
from swiftlm.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama",)
# every GGUF block type MLX reads natively (Q4_0, Q4_1, Q8_0) has 32-wide blocks
GGUF_GROUP_SIZE = 32

# GGUF tensor names -> mlx-lm llama parameter names
_GGUF_NAMES = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
]


@lru_cache(maxsize=1)
def supported_architectures() -> frozenset[str]:
    """The ``model_type`` values mlx-lm can load: mlx-lm imports ``mlx_lm.models.<model_type>`` (after its
    ``MODEL_REMAPPING``) and takes its ``Model`` and ``ModelArgs``, so an architecture is a module that
    defines or imports both at top level (read from the source, without importing ~130 modules); helper
    modules (``base``, ``cache``, ``rope_utils``, ``mla``, ``ssm``, ...) are not."""
    import ast
    from pathlib import Path

    import mlx_lm.models
    from mlx_lm.utils import MODEL_REMAPPING

    root = Path(mlx_lm.models.__path__[0])
    names = set()
    for m in pkgutil.iter_modules([str(root)]):
        try:
            tree = ast.parse((root / f"{m.name}.py").read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        top: set[str] = set()
        needs: set[str] = set()  # absolute imports at module level (also inside try:), e.g. olmo's hf_olmo
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                top.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                top.update(t.id for t in node.targets if isinstance(t, ast.Name))
            for sub in ast.walk(node) if isinstance(node, (ast.Import, ast.ImportFrom, ast.Try)) else ():
                if isinstance(sub, ast.Import):
                    needs.update(a.name.split(".")[0] for a in sub.names)
                elif isinstance(sub, ast.ImportFrom) and not sub.level and sub.module:
                    needs.add(sub.module.split(".")[0])
        if {"Model", "ModelArgs"} <= top and all(_importable(n) for n in needs):
            names.add(m.name)
    return frozenset(names | {k for k, v in MODEL_REMAPPING.items() if v in names})


@cache
def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _to_compute_dtype(model: nn.Module) -> None:
    """On the CPU, compute in float32: MLX's CPU kernels are fastest in fp32 and its
    ``gather_mm`` (MoE layers) accepts only fp32.  Metal keeps the checkpoint's dtype."""
    if _on_cpu():
        model.set_dtype(mx.float32)


def load_hf(spec: ModelSpec, cfg: Any = None, shard: Any = None) -> tuple[nn.Module, Any, dict, Any]:
    """(model, tokenizer, config, expert reader or None).  With ``cfg.stream_experts`` the
    weights are loaded lazily and the experts replaced by streamed layers before evaluation;
    ``shard`` (distributed.shard_module) splits the lazily loaded model before evaluation, so a
    rank reads only its part of the weights."""
    from pathlib import Path

    from mlx_lm.utils import load_model

    stream = bool(getattr(cfg, "stream_experts", False))
    layout = reader = None
    if stream:
        from swiftlm.memory import streamable_layout

        layout = streamable_layout(spec)  # a clear error for dense models and GGUF files
    try:
        model, config = load_model(Path(spec.path), lazy=stream or shard is not None)
    except (ValueError, KeyError) as exc:
        raise CorruptModel(f"{spec.path}: mlx-lm could not build the model from its weights: {exc}") from exc
    if shard is not None:
        shard(model)
    if stream:
        from swiftlm.experts import ExpertReader

        from .streamed_moe import attach

        reader = ExpertReader(
            layout, mode=cfg.expert_read_mode, workers=cfg.expert_read_threads, chunk=max(1, spec.experts_per_token)
        )
        attach(model, layout, reader, mx.float32 if _on_cpu() else None, prefetch=cfg.expert_prefetch)
    _to_compute_dtype(model)
    mx.eval(model.parameters())
    return model, load_hf_tokenizer(spec.path, config), config, reader


def gguf_name_to_mlx(name: str) -> str:
    for pat, rep in _GGUF_NAMES:
        new, n = re.subn(pat, rep, name)
        if n:
            return new
    raise CorruptModel(f"unexpected tensor {name!r} in a llama GGUF")


def load_gguf(spec: ModelSpec, shard: Any = None) -> tuple[nn.Module, Any, dict]:
    from mlx_lm.models import llama

    if spec.arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {spec.arch!r} is not supported by the mlx backend; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)} (for others, give an HF-format directory)"
        )
    try:
        raw = mx.load(str(spec.path))
    except Exception as exc:
        raise CorruptModel(f"{spec.path} could not be read by mlx: {exc}") from exc
    weights = {gguf_name_to_mlx(k): v for k, v in raw.items()}
    config = dict(spec.config)
    # llama.cpp stores Q/K rows permuted for interleaved ("traditional") RoPE.
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        rms_norm_eps=config["rms_norm_eps"],
        vocab_size=config["vocab_size"],
        head_dim=config["head_dim"],
        max_position_embeddings=config["max_position_embeddings"],
        num_key_value_heads=config["num_key_value_heads"],
        rope_theta=config["rope_theta"],
        rope_traditional=True,
        tie_word_embeddings=config["tie_word_embeddings"],
    )
    model = llama.Model(args)
    quant = {}
    for k, w in weights.items():
        if k.endswith(".scales"):
            base = k[: -len(".scales")]
            packed = weights[base + ".weight"]
            group = GGUF_GROUP_SIZE
            bits = packed.shape[-1] * 32 // (w.shape[-1] * group)
            quant[base] = {"group_size": group, "bits": int(bits)}
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise CorruptModel(f"{spec.path}: weights do not match a llama model: {exc}") from exc
    if shard is not None:
        shard(model)
    _to_compute_dtype(model)
    mx.eval(model.parameters())
    tokenizer = load_gguf_tokenizer(spec.gguf_meta or {})
    config["quantization"] = quant
    return model, tokenizer, config
