#!/usr/bin/env python3
"""Write a random-weight checkpoint in Hugging Face hub layout.

    python scripts/make_checkpoint.py OUT --arch llama|qwen3|qwen3_moe|mixtral \
        [--hidden 256 --layers 4 --heads 4 --kv-heads 2 --intermediate 512 \
         --experts 8 --experts-per-token 2 --moe-intermediate 256] \
        [--dtype bfloat16|float16|float32] [--shard-mb 50] [--quantize 4] [--seed 0]

config.json, sharded safetensors with model.safetensors.index.json, and the SmolLM2
tokenizer (from the bundled GGUF) with its chat template.  ``--quantize BITS`` writes MLX's
quantized format through mlx-lm (needs mlx).  For shape coverage, MoE streaming and speed
only: random weights say nothing about output quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swiftlm.convert import _save_bf16  # noqa: E402
from swiftlm.registry import resolve  # noqa: E402
from swiftlm.tokenizer import load_gguf_tokenizer  # noqa: E402

ARCHES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gemma")


def make_config(a: argparse.Namespace, vocab: int, bos: int, eos: int) -> dict:
    head_dim = a.head_dim or a.hidden // a.heads
    cfg = {
        "model_type": a.arch, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": head_dim,
        "intermediate_size": a.intermediate, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": a.ctx, "tie_word_embeddings": a.tie,
        "hidden_act": "silu", "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": a.dtype,
        "attention_bias": False,
    }
    cfg["architectures"] = {"llama": ["LlamaForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                            "qwen3_moe": ["Qwen3MoeForCausalLM"], "mixtral": ["MixtralForCausalLM"],
                            "gemma": ["GemmaForCausalLM"]}[a.arch]
    if a.arch == "gemma":
        cfg.update({"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True})
    if a.arch == "qwen3_moe":
        cfg.update({"num_experts": a.experts, "num_experts_per_tok": a.experts_per_token,
                    "moe_intermediate_size": a.moe_intermediate, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "norm_topk_prob": True, "sliding_window": None, "use_sliding_window": False})
    if a.arch == "mixtral":
        cfg.update({"num_local_experts": a.experts, "num_experts_per_tok": a.experts_per_token,
                    "sliding_window": None})
    return cfg


def make_weights(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    H, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    arch = cfg["model_type"]

    def lin(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f), dtype=np.float32) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # Gemma stores w where the norm multiplies by (1 + w)
        base = 0.0 if arch == "gemma" else 1.0
        return (base + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((V, H), dtype=np.float32) * 0.5,
         "model.norm.weight": norm(H)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, nh * hd)
        if arch in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        if arch == "qwen3_moe":
            E, MI = cfg["num_experts"], cfg["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = lin(E, H)
            for e in range(E):
                w[p + f"mlp.experts.{e}.gate_proj.weight"] = lin(MI, H)
                w[p + f"mlp.experts.{e}.up_proj.weight"] = lin(MI, H)
                w[p + f"mlp.experts.{e}.down_proj.weight"] = lin(H, MI)
        elif arch == "mixtral":
            E = cfg["num_local_experts"]
            w[p + "block_sparse_moe.gate.weight"] = lin(E, H)
            for e in range(E):
                w[p + f"block_sparse_moe.experts.{e}.w1.weight"] = lin(I, H)
                w[p + f"block_sparse_moe.experts.{e}.w2.weight"] = lin(H, I)
                w[p + f"block_sparse_moe.experts.{e}.w3.weight"] = lin(I, H)
        else:
            w[p + "mlp.gate_proj.weight"] = lin(I, H)
            w[p + "mlp.up_proj.weight"] = lin(I, H)
            w[p + "mlp.down_proj.weight"] = lin(H, I)
    return w


def save_sharded(weights: dict[str, np.ndarray], out: Path, dtype: str, shard_bytes: int) -> None:
    from safetensors.numpy import save_file

    itemsize = 2 if dtype in ("float16", "bfloat16") else 4
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in weights.items():
        nbytes = arr.size * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += nbytes
    n = len(shards)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        if dtype == "bfloat16":
            _save_bf16(shard, out / fname)
        else:
            save_file({k: v.astype(dtype) for k, v in shard.items()}, str(out / fname), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.size * itemsize
    if n > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


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
    ap.add_argument("--quantize", type=int, choices=(2, 3, 4, 6, 8), default=None,
                    help="write MLX-quantized weights with this many bits (needs mlx)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)

    out = Path(a.out)
    if out.exists():
        if not a.force:
            ap.error(f"{out} exists (use --force)")
        shutil.rmtree(out)
    spec = resolve(None)  # the bundled SmolLM2 GGUF carries the tokenizer
    tok = load_gguf_tokenizer(spec.gguf_meta or {})
    bos = tok.tok.token_to_id(tok.bos_token) if tok.bos_token else 1
    eos = tok.tok.token_to_id(tok.eos_token) if tok.eos_token else 2
    cfg = make_config(a, tok.vocab_size, bos, eos)
    weights = make_weights(cfg, np.random.default_rng(a.seed))
    target = Path(tempfile.mkdtemp(prefix="swiftlm-ckpt-")) if a.quantize else out
    target.mkdir(parents=True, exist_ok=True)
    save_sharded(weights, target, a.dtype, int(a.shard_mb * 1e6) if a.shard_mb else 1 << 62)
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(target)
    if a.quantize:
        from mlx_lm.convert import convert

        convert(str(target), str(out), quantize=True, q_bits=a.quantize, q_group_size=a.group_size)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # keep our tokenizer files as written
            shutil.copy(target / f, out / f)
        shutil.rmtree(target)
    print(out)
    return out


if __name__ == "__main__":
    main()
