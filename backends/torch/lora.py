"""LoRA adapters on the torch model: read PEFT / mlx-lm adapter files, serve many adapters on one
loaded base with per-row selection, and the trainable form the finetuner (swiftlm/finetune.py) uses.

How a projection gets its adapter term: the model fuses q/k/v into one ``qkv`` matmul and gate/up
into one ``gate_up`` matmul at load (model.py ``fuse``).  The base matmul is left as it is; each
projection holder (Attention, MLP, o_proj, down_proj) gets a ``lora`` object (``SiteLora``) that
adds ``scale * B[a] @ (A[a] @ x)`` for the rows whose sequence uses adapter ``a``, into the slice of
the fused output that the target projection owns (q, k or v; gate or up).  Rows are grouped by
adapter (a gathered per-row LoRA: one pair of small matmuls per adapter present in the step), and
rows with no adapter get nothing added, so their output is the base output bit for bit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from swiftlm.adapters import AdapterError, adapter_files, parse_spec  # noqa: F401 (re-exported)

from .archs_config import refuse_flag

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_T = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN + MLP_T
_PEFT = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$")
_MLX = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([ab])$")


class Adapter:
    """One adapter's weights: ``mods[(layer, proj)] = (A [r, in], B [out, r])`` and the scale."""

    def __init__(
        self,
        name: str,
        mods: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        scale: float,
        rank: int,
        targets: list[str],
    ):
        self.name, self.mods, self.scale, self.rank, self.targets = name, mods, scale, rank, targets


def read_adapter(name: str, path: str | Path) -> Adapter:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) or an mlx-lm one
    (adapter_config.json with lora_parameters + adapters.safetensors)."""
    from safetensors.torch import load_file

    f = adapter_files(name, path)
    r, scale, mlx = f.rank, f.scale, f.kind == "mlx"
    raw, rx, d = load_file(str(f.weights)), (_MLX if mlx else _PEFT), Path(path)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = rx.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a layer projection")
        ab = m.group(3).upper()
        # mlx-lm stores x @ lora_a @ lora_b: A^T [in, r] and B^T [r, out]
        halves.setdefault((int(m.group(1)), m.group(2)), {})[ab] = t.t().contiguous() if mlx else t
    mods = {}
    for k, h in halves.items():
        if set(h) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {k[0]} {k[1]} lacks its lora_A or lora_B weight")
        mods[k] = (h["A"], h["B"])
    if not mods:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in {d}")
    return Adapter(name, mods, scale, r, sorted({p for _, p in mods}))


class SiteLora:
    """The adapter terms of one fused projection (``qkv``, ``gate_up``, ``o_proj``, ``down_proj``)
    of one layer: ``parts`` are the target projections and their output slices."""

    def __init__(self, owner: LoraSet, layer: int, parts: list[tuple[str, int, int]]):
        self.owner, self.layer, self.parts = owner, layer, parts

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        groups = self.owner.active
        if not groups:
            return y
        for aid, rows in groups:
            ad = self.owner.adapters[aid]
            for proj, lo, hi in self.parts:
                w = ad.mods.get((self.layer, proj))
                if w is None:
                    continue
                A, B = w
                xs = x if rows is None else x.index_select(0, rows)
                d = (((xs.to(A.dtype) @ A.t()) @ B.t()) * ad.scale).to(y.dtype)  # (training: fp32 A/B)
                if rows is None:
                    y[:, lo:hi] += d
                else:
                    y[:, lo:hi].index_add_(0, rows, d)
        return y


class LoraSet:
    """The adapters served on one model, and which rows use which in the forward running now.
    Index 0 means "no adapter"; adapters are numbered from 1 in load order."""

    def __init__(self, module: Any):
        self.module = module
        self.adapters: list[Adapter | None] = [None]
        self.names: dict[str, int] = {}
        self.active: list[tuple[int, torch.Tensor | None]] = []
        self._attach()

    def _attach(self) -> None:
        a = self.module.a
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        for i, blk in enumerate(self.module.layers):
            attn = blk.self_attn
            attn.lora = SiteLora(self, i, [("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)])
            _hook(attn.o_proj, SiteLora(self, i, [("o_proj", 0, attn.o_proj.weight.shape[0])]))
            mlp = blk.mlp
            if hasattr(mlp, "gate_up"):
                n = mlp.gate_up.shape[0] // 2
                mlp.lora = SiteLora(self, i, [("gate_proj", 0, n), ("up_proj", n, 2 * n)])
                _hook(mlp.down_proj, SiteLora(self, i, [("down_proj", 0, mlp.down_proj.weight.shape[0])]))

    def add(self, ad: Adapter) -> int:
        """Check the shapes against the model, move the weights to its device and dtype."""
        a, m = self.module.a, self.module
        if ad.name in self.names:
            raise AdapterError(f"adapter name {ad.name!r} is used twice")
        dev, dt = m.embed_tokens.weight.device, m.embed_tokens.weight.dtype
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        dims = {
            "q_proj": (a.hidden, q),
            "k_proj": (a.hidden, kv),
            "v_proj": (a.hidden, kv),
            "o_proj": (q, a.hidden),
            "gate_proj": (a.hidden, a.intermediate),
            "up_proj": (a.hidden, a.intermediate),
            "down_proj": (a.intermediate, a.hidden),
        }
        for (layer, proj), (A, B) in list(ad.mods.items()):
            if layer >= a.layers:
                raise AdapterError(f"adapter {ad.name!r}: layer {layer} does not exist (the model has {a.layers})")
            if proj in MLP_T and not hasattr(m.layers[layer].mlp, "gate_up"):
                raise AdapterError(f"adapter {ad.name!r}: {proj} of a mixture-of-experts layer is not supported")
            fan_in, fan_out = dims[proj]
            if A.ndim != 2 or B.ndim != 2 or A.shape[1] != fan_in or B.shape[0] != fan_out or A.shape[0] != B.shape[1]:
                raise AdapterError(
                    f"adapter {ad.name!r}: layer {layer} {proj} has A {tuple(A.shape)} and B "
                    f"{tuple(B.shape)}, which do not fit this model ({fan_in} -> {fan_out})"
                )
            ad.mods[(layer, proj)] = (A.to(dev, dt), B.to(dev, dt))
        self.adapters.append(ad)
        self.names[ad.name] = len(self.adapters) - 1
        return self.names[ad.name]

    def index(self, name: str | None) -> int:
        if not name:
            return 0
        if name not in self.names:
            raise KeyError(name)
        return self.names[name]

    @contextmanager
    def rows(self, ids: list[int] | None = None, device: Any = None, single: int = 0) -> Iterator[None]:
        """Select adapters for the next forward: ``single`` for every row, or ``ids[i]`` for row i."""
        groups: list[tuple[int, torch.Tensor | None]] = []
        if single:
            groups = [(single, None)]
        elif ids:
            for aid in sorted(set(ids) - {0}):
                groups.append((aid, torch.tensor([i for i, x in enumerate(ids) if x == aid], device=device)))
        self.active = groups
        try:
            yield
        finally:
            self.active = []


def _hook(lin: torch.nn.Module, site: SiteLora) -> None:
    """o_proj / down_proj: ``out_proj`` reads ``lin.lora``; a direct ``lin(x)`` call runs this hook."""
    lin.lora = site
    lin.register_forward_hook(lambda mod, args, out: mod.lora(args[0], out))


def attach(module: Any, specs: list[str]) -> LoraSet:
    """``--adapter NAME=PATH`` entries loaded onto ``module``."""
    refuse_flag(module.a, "--adapter")
    ls = LoraSet(module)
    for s in specs:
        name, path = parse_spec(s)
        ls.add(read_adapter(name, path))
    return ls


# ---------------------------------------------------------------------- training side (finetune.py)
def new_adapter(module: Any, name: str, rank: int, alpha: float, targets: list[str], seed: int = 0) -> Adapter:
    """A fresh trainable adapter as PEFT initialises one: A Kaiming-uniform, B zero (no change at step 0)."""
    a = module.a
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    dims = {
        "q_proj": (a.hidden, q),
        "k_proj": (a.hidden, kv),
        "v_proj": (a.hidden, kv),
        "o_proj": (q, a.hidden),
        "gate_proj": (a.hidden, a.intermediate),
        "up_proj": (a.hidden, a.intermediate),
        "down_proj": (a.intermediate, a.hidden),
    }
    bad = sorted(set(targets) - set(TARGETS))
    if bad:
        raise AdapterError(f"target module {bad[0]!r} is not one of {', '.join(TARGETS)}")
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(a.layers):
        for proj in targets:
            fan_in, fan_out = dims[proj]
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), PEFT's default for lora_A
            A = ((torch.rand(rank, fan_in, generator=g) * 2 - 1) * bound).requires_grad_(True)
            B = torch.zeros(fan_out, rank, requires_grad=True)
            mods[(layer, proj)] = (A, B)
    return Adapter(name, mods, alpha / rank, rank, list(targets))


def save_peft(ad: Adapter, out: str | Path, alpha: float, base: str) -> None:
    from safetensors.torch import save_file

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, proj), (A, B) in ad.mods.items():
        where = "self_attn" if proj in ATTN else "mlp"
        pre = f"base_model.model.model.layers.{layer}.{where}.{proj}"
        tensors[f"{pre}.lora_A.weight"] = A.detach().float().cpu().contiguous()
        tensors[f"{pre}.lora_B.weight"] = B.detach().float().cpu().contiguous()
    save_file(tensors, str(d / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": ad.rank,
        "lora_alpha": alpha,
        "target_modules": ad.targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": base,
    }
    (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def merged_state(state: dict[str, torch.Tensor], ad: Adapter) -> dict[str, torch.Tensor]:
    """HF-named base weights with ``W + scale * B @ A`` folded into each adapted projection."""
    out = dict(state)
    for (layer, proj), (A, B) in ad.mods.items():
        where = "self_attn" if proj in ATTN else "mlp"
        key = f"model.layers.{layer}.{where}.{proj}.weight"
        if key not in out:
            raise AdapterError(f"the base checkpoint has no {key} to fuse into")
        w = out[key]
        out[key] = (w.float() + ad.scale * (B.detach().float() @ A.detach().float())).to(w.dtype)
    return out
