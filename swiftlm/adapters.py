"""LoRA adapter directories, read the same way by every backend (no arrays here): the
``--adapter NAME=PATH`` spec, the format (PEFT or mlx-lm), its rank and scale, and the one-sentence
refusals of what no backend implements.  The backends (``backends/*/lora.py``) load the weights
and apply them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError


class AdapterError(ConfigError):
    """An adapter that cannot be applied to this model (the message is one sentence)."""


def parse_spec(text: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); a ValueError in one sentence otherwise."""
    name, sep, path = str(text).partition("=")
    if not sep or not name.strip() or not path.strip() or ":" in name:
        raise ValueError(f"--adapter {text!r}: expected NAME=PATH (a name without ':' and an adapter directory)")
    return name.strip(), path.strip()


@dataclass
class AdapterFiles:
    """An adapter directory's format, weights file, rank and scale."""

    kind: str  # "peft" (A [r, in], B [out, r]) or "mlx" (lora_a [in, r], lora_b [r, out])
    weights: Path
    rank: int
    scale: float


def adapter_files(name: str, path: str | Path) -> AdapterFiles:
    """Read and check ``adapter_config.json``: a PEFT LoRA (adapter_model.safetensors; scale
    lora_alpha / r, or / sqrt(r) with use_rslora) or an mlx-lm one (adapters.safetensors with
    lora_parameters)."""
    d = Path(path)
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"adapter {name!r}: {d} has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"adapter {name!r}: {cfg_file} is not JSON ({exc.msg})") from None
    if (d / "adapter_model.safetensors").is_file():
        if cfg.get("peft_type", "LORA") != "LORA":
            raise AdapterError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LoRA")
        for field in ("use_dora", "fan_in_fan_out"):
            if cfg.get(field):
                raise AdapterError(f"adapter {name!r}: {field}=true is not supported")
        if (
            cfg.get("bias", "none") != "none"
            or cfg.get("alpha_pattern")
            or cfg.get("rank_pattern")
            or cfg.get("modules_to_save")
        ):
            raise AdapterError(
                f"adapter {name!r}: LoRA bias, alpha_pattern, rank_pattern and modules_to_save are not supported"
            )
        r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        return AdapterFiles("peft", d / "adapter_model.safetensors", r, scale)
    if (d / "adapters.safetensors").is_file():
        lp = cfg.get("lora_parameters") or {}
        if cfg.get("fine_tune_type", "lora") != "lora":
            raise AdapterError(f"adapter {name!r}: fine_tune_type {cfg.get('fine_tune_type')!r} is not lora")
        return AdapterFiles("mlx", d / "adapters.safetensors", int(lp.get("rank", 8)), float(lp.get("scale", 20.0)))
    raise AdapterError(f"adapter {name!r}: {d} has neither adapter_model.safetensors nor adapters.safetensors")
