#!/usr/bin/env python3
"""Write an HF-format llama / qwen2 / qwen3 checkpoint as a GGUF file, laid out as llama.cpp's
``convert_hf_to_gguf.py`` lays it out (for tests: no llama.cpp checkout is needed).

    python scripts/write_gguf.py HF_DIR OUT.gguf [--type f32|f16|q8_0] [--pre NAME]

What it mirrors of the converter:
- tensor names through gguf-py's own ``TensorNameMap`` (``blk.N.attn_q.weight``, ``attn_q.bias``,
  ``attn_q_norm``, ``token_embd``, ``output`` (absent when the embeddings are tied), ...);
- Q/K rows permuted for interleaved rope for ``llama`` only (``LlamaModel.permute``); ``qwen2`` /
  ``qwen3`` keep HF's rows;
- metadata as ``TextModel.set_gguf_parameters``: ``<arch>.context_length``, ``.embedding_length``,
  ``.block_count``, ``.feed_forward_length``, ``.attention.head_count(_kv)``, ``.rope.freq_base``,
  ``.attention.layer_norm_rms_epsilon``, ``.attention.key_length`` / ``.value_length`` (when config.json
  has ``head_dim``), rope scaling when config.json has one; llama adds ``.vocab_size`` and
  ``.rope.dimension_count``;
- 1-D tensors (norms, biases) stay F32; 2-D ones take ``--type`` (Q8_0 through ``gguf.quants.quantize``);
- the tokenizer (``gpt2`` byte-level BPE) from tokenizer.json / tokenizer_config.json: tokens, token
  types (added special tokens CONTROL, other added tokens USER_DEFINED), merges, the pre-tokenizer name
  (``--pre``; by default guessed from tokenizer.json's pre-tokenizer), bos / eos ids, chat template.

``write_gguf(..., arch=..., extra=...)`` (Python) can override ``general.architecture`` and add metadata,
which the tests use to build GGUFs the torch backend must refuse.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
TYPES = ("f32", "f16", "q8_0")


def _load_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:  # pt: bf16 checkpoints too
            for k in fh.keys():
                out[k] = fh.get_tensor(k).float().numpy()
    if not out:
        raise SystemExit(f"{hf_dir} holds no .safetensors weights")
    return out


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's rotate-half rows -> interleaved (GGML) rope rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _guess_pre(tj: dict) -> str:
    from swiftlm.tokenizer import _SPLIT_PRE

    pt = tj.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", [pt]) if pt.get("type") == "Sequence" else [pt]
    for s in steps:
        if s.get("type") == "Split":
            pattern = (s.get("pattern") or {}).get("Regex")
            for name, rx in _SPLIT_PRE.items():
                if pattern == rx:
                    return name
        if s.get("type") == "Digits" and s.get("individual_digits"):
            return "smollm"
    return "gpt-2"


def _add_tokenizer(w: Any, hf_dir: Path, config: dict, pre: str | None) -> None:
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    model = tj["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"tokenizer model {model.get('type')!r}: only byte-level BPE is written")
    vocab: dict[str, int] = dict(model["vocab"])
    special: dict[int, bool] = {}
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        special[t["id"]] = bool(t.get("special"))
    n = max(int(config.get("vocab_size") or 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # UNUSED
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = 1  # NORMAL
    for i, sp in special.items():
        types[i] = 3 if sp else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or _guess_pre(tj))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)

    def tid(key: str) -> int | None:
        v = tc.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return vocab.get(v) if isinstance(v, str) else None

    bos = tid("bos_token") if tid("bos_token") is not None else config.get("bos_token_id")
    eos = tid("eos_token") if tid("eos_token") is not None else config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos))
    pad = tid("pad_token")
    if pad is not None:
        w.add_pad_token_id(int(pad))
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


def write_gguf(
    hf_dir: str | Path,
    out: str | Path,
    qtype: str = "f32",
    *,
    arch: str | None = None,
    extra: dict[str, Any] | None = None,
    pre: str | None = None,
) -> Path:
    """``arch``: write this ``general.architecture`` instead of the checkpoint's (its keys under that
    name); ``extra``: more metadata, ``{key: value}`` (int -> uint32, float -> float32, str, bool)."""
    import gguf

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    if model_type not in ARCHS:
        raise SystemExit(f"model_type {model_type!r}: this writer handles {', '.join(ARCHS)}")
    march = getattr(gguf.MODEL_ARCH, ARCHS[model_type])
    name = arch or gguf.MODEL_ARCH_NAMES[march]
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    tmap = gguf.get_tensor_name_map(march, n_layers)
    ftype = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[qtype]

    w = gguf.GGUFWriter(str(out), name)
    w.add_name(hf_dir.name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rp = config.get("rope_parameters") or {}  # transformers 5 writes rope_theta / rope_type in here
    w.add_rope_freq_base(float(config.get("rope_theta") or rp.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if config.get("head_dim") is not None:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if model_type in ("llama", "mistral"):
        w.add_vocab_size(config["vocab_size"])
        w.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    rs = config.get("rope_scaling") or rp
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype in ("linear", "yarn") and rs.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rtype == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        if rs.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
    w.add_file_type(ftype)
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    _add_tokenizer(w, hf_dir, config, pre)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    weights = _load_weights(hf_dir)
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)  # as transformers saves a tied checkpoint: no output tensor
    for hf, arr in weights.items():
        if model_type in ("llama", "mistral") and hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            arr = permute(arr, heads)
        elif model_type in ("llama", "mistral") and hf.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            arr = permute(arr, kv_heads)
        gname = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise SystemExit(f"no GGUF name for tensor {hf!r}")
        arr = np.ascontiguousarray(arr.astype(np.float32))
        if arr.ndim == 1 or qtype == "f32":
            w.add_tensor(gname, arr)
        elif qtype == "f16":
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--type", choices=TYPES, default="f32")
    ap.add_argument("--pre", default=None, help="tokenizer.ggml.pre (default: guessed from tokenizer.json)")
    a = ap.parse_args(argv)
    out = write_gguf(a.hf_dir, a.out, a.type, pre=a.pre)
    print(out)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
