"""``swiftlm convert``: a llama-family GGUF -> an HF-format directory.

The output loads with mlx-lm's ``load`` and with transformers: config.json, tokenizer.json
and tokenizer_config.json (with the chat template), and safetensors weights either
dequantized to fp16/bf16/fp32 (numpy + gguf-py, no mlx or torch needed) or kept 4/8-bit in
MLX's quantized layout (delegated to the mlx backend, which owns that format).

llama.cpp stores the Q and K projections of ``llama`` GGUFs with their rows permuted for
interleaved ("traditional") RoPE; HF checkpoints use the rotate-half layout, so those rows are
put back.  ``qwen2`` / ``qwen3`` GGUFs keep HF's row order (llama.cpp runs them with NEOX-style
rope, which is HF's rotate-half), so nothing is permuted for them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SwiftLMError, UnsupportedArchitecture
from .registry import ModelSpec, resolve
from .tokenizer import load_gguf_tokenizer

HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",  # qwen3's per-head q/k RMSNorms
}

# The GGUF architectures read here (general.architecture -> HF model_type, HF class, whether
# llama.cpp's converter permuted the Q/K rows: it does so for the llama family only, see
# LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py; Qwen2Model / Qwen3Model write HF's rows).
GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'.  A tensor this mapping does
    not know (experts, ``rope_freqs``, another architecture's) is refused naming it."""
    parts = gguf_name.split(".")
    key = parts[2] if parts[0] == "blk" and len(parts) > 3 else parts[0]
    if key not in HF_NAMES or (parts[0] == "blk" and len(parts) <= 3):
        raise UnsupportedArchitecture(
            f"GGUF tensor {gguf_name!r} has no HF-format counterpart in this reader "
            f"(it reads the tensors of the {', '.join(GGUF_ARCHS)} architectures)"
        )
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_NAMES[key]}.{'.'.join(parts[3:])}"
    return f"{HF_NAMES[key]}.{'.'.join(parts[1:])}"


def unpermute_rows(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (axis 0 = output rows; works for packed
    quantized rows and their scales too, since groups run along the input axis)."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape((n_heads, rows // n_heads // 2, 2) + rest).swapaxes(1, 2).reshape((rows,) + rest)


def hf_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """The HF config.json of a GGUF of one of ``GGUF_ARCHS`` (from the metadata the registry read:
    ``<arch>.embedding_length``, ``.block_count``, ``.attention.head_count(_kv)``, ``.attention.key_length``,
    ``.rope.freq_base``, ``.attention.layer_norm_rms_epsilon``, ``.context_length``, ...)."""
    arch = spec.arch if spec.arch in GGUF_ARCHS else "llama"
    model_type, cls, _ = GGUF_ARCHS[arch]
    cfg = dict(spec.config)
    cfg.update(
        {
            "architectures": [cls],
            "model_type": model_type,
            "torch_dtype": dtype,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "use_cache": True,
        }
    )
    if cfg.get("rms_norm_eps"):  # stored as float32: 1e-06 reads back as 9.99999997e-07
        cfg["rms_norm_eps"] = float(f"{float(cfg['rms_norm_eps']):.7g}")
    if model_type == "llama":
        cfg["pretraining_tp"] = 1
    else:  # llama.cpp's qwen2 / qwen3 GGUFs carry no sliding window (refused if one is there)
        cfg.update(
            {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.get("num_hidden_layers", 0)}
        )
    return cfg


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise SwiftLMError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def convert_gguf(
    source: str, out_dir: str, dtype: str = "float16", keep_quantized: bool = False, force: bool = False
) -> Path:
    spec = resolve(source)
    if spec.format != "gguf":
        raise SwiftLMError(f"{source} is not a GGUF model; convert takes a .gguf file")
    if spec.arch not in GGUF_ARCHS or (keep_quantized and spec.arch != "llama"):
        supported = ", ".join(GGUF_ARCHS) if not keep_quantized else "llama (with --keep-quantized)"
        raise UnsupportedArchitecture(f"convert supports {supported} GGUF files; this one is {spec.arch!r}")
    out = Path(out_dir)
    _prepare_out(out, force)
    config = hf_config(spec, dtype)
    if keep_quantized:
        from .backend import discover_backends

        entry = discover_backends().get("mlx")
        if entry is None or entry.backend is None or not entry.availability.ok:
            raise SwiftLMError(
                "--keep-quantized writes MLX's quantized format and needs the mlx backend (pip install 'swiftlm[mlx]')"
            )
        config["quantization"] = entry.backend.export_quantized_gguf(spec, out, dtype)  # type: ignore[attr-defined]
    else:
        _write_dequantized(spec, out, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}, indent=2)
    )
    load_gguf_tokenizer(spec.gguf_meta or {}).save_pretrained(out)
    return out


def iter_dequantized(spec: ModelSpec) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 array) for every tensor of a GGUF of one of ``GGUF_ARCHS``: dequantized with
    gguf-py, Q/K rows put back in HF order where llama.cpp permuted them (llama only).  Shared by
    `convert` and the torch backend's loader."""
    from gguf import GGMLQuantizationType

    from .gguf_file import read_gguf_header

    _, tensors = read_gguf_header(spec.path)
    raw = np.memmap(spec.path, dtype=np.uint8, mode="r")
    heads, kv_heads = spec.config["num_attention_heads"], spec.config["num_key_value_heads"]
    permuted = GGUF_ARCHS.get(spec.arch, GGUF_ARCHS["llama"])[2]
    names = [hf_name(t.name) for t in tensors]  # refuses an unknown tensor before any is dequantized
    for t, name in zip(tensors, names):
        shape = tuple(reversed(t.shape))  # numpy order: rows first
        data = np.asarray(raw[t.offset : t.offset + t.n_bytes])
        arr = dequantize_blocks(data, GGMLQuantizationType(t.type_id)).reshape(shape)
        if permuted and ".self_attn.q_proj." in name:  # weights and (if any) biases: the same row order
            arr = unpermute_rows(arr, heads)
        elif permuted and ".self_attn.k_proj." in name:
            arr = unpermute_rows(arr, kv_heads)
        yield name, np.ascontiguousarray(arr)


DEQUANT_CHUNK = 1 << 15  # bytes of blocks per gguf-py call: its temporaries stay in the core's cache


def dequantize_blocks(data: np.ndarray, qtype: Any) -> np.ndarray:
    """gguf-py's ``dequantize`` of one tensor's bytes as float32, the same values, in chunks of whole blocks: gguf-py
    makes several full-size temporaries per call, and over a large tensor each of its passes goes to memory.  The
    bundled 135M Q4_1 / Q8_0 model: 1.17 -> 0.53 s on this project's CPU (threads over the chunks were slower on
    two cores)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    step = max(block_bytes, DEQUANT_CHUNK // block_bytes * block_bytes)
    if qtype.name in ("F32", "F16", "BF16") or data.size <= step:  # a copy: F32's would be a view of the file's map
        return np.array(dequantize(data, qtype), dtype=np.float32).ravel()
    out = np.empty(data.size // block_bytes * block, dtype=np.float32)
    per = step // block_bytes * block  # values per chunk
    for i in range(-(-data.size // step)):
        out[i * per : (i + 1) * per] = dequantize(data[i * step : (i + 1) * step], qtype).ravel()
    return out


def _write_dequantized(spec: ModelSpec, out: Path, dtype: str) -> None:
    from safetensors.numpy import save_file

    np_dtype = {"float16": np.float16, "float32": np.float32, "bfloat16": np.float32}[dtype]
    weights = {name: arr.astype(np_dtype) for name, arr in iter_dequantized(spec)}
    if dtype == "bfloat16":
        _save_bf16(weights, out / "model.safetensors")
    else:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def _save_bf16(weights: dict[str, np.ndarray], path: Path) -> None:
    """numpy has no bfloat16: write the safetensors file by hand (round to nearest even)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, arr in weights.items():
        bits = arr.astype(np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        blob = rounded.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as fh:
        fh.write(len(h).to_bytes(8, "little"))
        fh.write(h)
        for b in blobs:
            fh.write(b)
