"""LoRA adapters on the MLX backend: mlx-lm and PEFT adapter directories served on one loaded base,
chosen per request (``--adapter NAME=PATH``, the request's ``model``), several in one decode batch.

How a projection gets its adapter term: each target ``nn.Linear`` / ``nn.QuantizedLinear`` of the
mlx-lm module keeps its weights and parameter names; its class is swapped for a subclass whose
``__call__`` adds ``scale * (x @ lora_a) @ lora_b`` -- the arithmetic of mlx-lm's ``LoRALinear``,
in the same order -- for the rows whose sequence uses an adapter.  Which rows use which adapter is
set around each forward (``LoraSet.rows``); MLX builds its graph while the Python code runs, so the
selection is read when the forward is traced.  Rows with no adapter get the base output untouched
(``mx.where`` picks ``y`` itself), and a forward with no adapter rows is the base forward.  The
adapter weights are held outside the module tree (not parameters: ``load_weights`` / weight counts
do not see them).

Formats: mlx-lm (``adapters.safetensors`` with ``<module path>.lora_a`` [in, r] / ``.lora_b`` [r, out],
``adapter_config.json`` with ``lora_parameters.scale``) and PEFT (``adapter_model.safetensors`` with
``base_model.model.<HF module path>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r], scale
``lora_alpha / r`` or ``lora_alpha / sqrt(r)`` with ``use_rslora``), converted to mlx-lm's layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from swiftlm.adapters import AdapterError, adapter_files, parse_spec  # noqa: F401 (re-exported)

from .cpu_split import plain_type, unsplit


class Adapter:
    """One adapter: ``mods[module path] = (lora_a [in, r], lora_b [r, out])`` and its scale."""

    def __init__(self, name: str, mods: dict[str, tuple[mx.array, mx.array]], scale: float, rank: int):
        self.name, self.mods, self.scale, self.rank = name, mods, scale, rank


def read_adapter(name: str, path: str | Path) -> Adapter:
    """An mlx-lm adapter directory, or a PEFT one (its A/B transposed to mlx-lm's layout)."""
    f = adapter_files(name, path)
    d = Path(path)
    halves: dict[str, dict[str, mx.array]] = {}
    for key, t in mx.load(str(f.weights)).items():
        if f.kind == "mlx":
            mod, _, leaf = key.rpartition(".")
            if leaf not in ("lora_a", "lora_b") or not mod:
                raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA lora_a/lora_b weight")
            halves.setdefault(mod, {})[leaf] = t
            continue
        k = key.removeprefix("base_model.model.").replace(".default.weight", ".weight")
        for tag, leaf in ((".lora_A.weight", "lora_a"), (".lora_B.weight", "lora_b")):
            if k.endswith(tag):
                halves.setdefault(k[: -len(tag)], {})[leaf] = t.T  # PEFT: A [r, in], B [out, r]
                break
        else:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight")
    rank, scale = f.rank, f.scale
    mods = {}
    for mod, h in halves.items():
        if set(h) != {"lora_a", "lora_b"}:
            raise AdapterError(f"adapter {name!r}: {mod} lacks its lora_a or lora_b weight")
        mods[mod] = (h["lora_a"], h["lora_b"])
    if not mods:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in {d}")
    return Adapter(name, mods, scale, rank)


class _Sites:
    """A projection's adapters (index -> (lora_a, lora_b, scale)) and its set; a plain object, so
    nn.Module stores it as an attribute and not in its parameter tree."""

    def __init__(self, owner: LoraSet):
        self.owner = owner
        self.ads: dict[int, tuple[mx.array, mx.array, float]] = {}


def _lora_call(self: Any, base_call: Any, x: mx.array) -> mx.array:
    y = base_call(self, x)
    sites: _Sites = self._swiftlm_lora
    sel = sites.owner.active
    if not sel:
        return y
    for aid, mask in sel:
        w = sites.ads.get(aid)
        if w is None:
            continue
        a, b, scale = w
        z = (x @ a) @ b  # mlx-lm's LoRALinear, term for term
        yz = y + (scale * z).astype(x.dtype)
        y = yz if mask is None else mx.where(mask, yz, y)
    return y


class _LoraLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return _lora_call(self, nn.Linear.__call__, x)


class _LoraQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        return _lora_call(self, nn.QuantizedLinear.__call__, x)


def _dims(layer: Any) -> tuple[int, int]:
    out_dims, in_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
    return in_dims, out_dims


class LoraSet:
    """The adapters served on one MLX module, and which rows use which in the forward traced now.
    Index 0 means "no adapter"; adapters are numbered from 1 in load order."""

    def __init__(self, module: Any):
        self.module = module
        self.adapters: list[Adapter | None] = [None]
        self.names: dict[str, int] = {}
        self.active: list[tuple[int, mx.array | None]] = []
        self._mods = dict(module.named_modules())

    def add(self, ad: Adapter) -> int:
        """Check every target against the module's projections and hook them."""
        if ad.name in self.names:
            raise AdapterError(f"adapter name {ad.name!r} is used twice")
        aid = len(self.adapters)
        checked = []
        for path, (a, b) in ad.mods.items():
            layer = self._mods.get(path)
            if layer is None:
                raise AdapterError(
                    f"adapter {ad.name!r}: {path} is not a module of this model (does the adapter "
                    "belong to another architecture?)"
                )
            if plain_type(layer) not in (nn.Linear, nn.QuantizedLinear, _LoraLinear, _LoraQuantizedLinear):
                raise AdapterError(
                    f"adapter {ad.name!r}: {path} is a {type(layer).__name__}; only linear "
                    "projections are supported (not embeddings or mixture-of-experts layers)"
                )
            fan_in, fan_out = _dims(layer)
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != fan_in or b.shape[1] != fan_out or a.shape[1] != b.shape[0]:
                raise AdapterError(
                    f"adapter {ad.name!r}: {path} has lora_a {tuple(a.shape)} and lora_b "
                    f"{tuple(b.shape)}, which do not fit this model ({fan_in} -> {fan_out})"
                )
            checked.append((layer, a, b))
        for layer, a, b in checked:
            unsplit(layer)  # a projection split over CPU streams (cpu_split.py) takes its adapter unsplit
            if type(layer) is nn.Linear:
                layer.__class__ = _LoraLinear
            elif type(layer) is nn.QuantizedLinear:
                layer.__class__ = _LoraQuantizedLinear
            if not isinstance(getattr(layer, "_swiftlm_lora", None), _Sites):
                layer._swiftlm_lora = _Sites(self)
            layer._swiftlm_lora.ads[aid] = (a, b, ad.scale)
        mx.eval([t for pair in ad.mods.values() for t in pair])
        self.adapters.append(ad)
        self.names[ad.name] = aid
        return aid

    def index(self, name: str | None) -> int:
        if not name:
            return 0
        if name not in self.names:
            raise KeyError(name)
        return self.names[name]

    @contextmanager
    def rows(self, ids: list[int] | None = None, single: int = 0) -> Iterator[None]:
        """Select adapters for the forward traced inside: ``single`` for every row, or ``ids[i]``
        (0: none) for row i of a [B, T, ...] batch."""
        sel: list[tuple[int, mx.array | None]] = []
        if single:
            sel = [(single, None)]
        elif ids and any(ids):
            if len(set(ids)) == 1:
                sel = [(ids[0], None)]
            else:
                for aid in sorted(set(ids) - {0}):
                    sel.append((aid, mx.array([x == aid for x in ids])[:, None, None]))
        prev, self.active = self.active, sel
        try:
            yield
        finally:
            self.active = prev


def attach(module: Any, specs: list[str]) -> LoraSet:
    """``--adapter NAME=PATH`` entries loaded onto ``module``."""
    ls = LoraSet(module)
    for s in specs:
        try:
            name, path = parse_spec(s)
        except ValueError as exc:
            raise AdapterError(str(exc)) from None
        ls.add(read_adapter(name, path))
    return ls
