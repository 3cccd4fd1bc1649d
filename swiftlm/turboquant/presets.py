"""KV-cache formats: the 16-bit default, TurboQuant presets and affine ``kv_bits`` quantization.

A ``KVFormat`` is what a backend needs to build one sequence's cache.  It is decided once per served
model (``settings_format``: ``--turbo-kv [PRESET]`` and its options, the model's ``kv_default``) and once
per request: ``SamplingParams.validate`` parses the request's ``turbo_kv`` / ``kv_bits`` fields
(``request_override``), the engine completes that at admission (``admitted_format``) and stores it on the
sequence (``Sequence.kv_format``); the scheduler hands it to the backend with every step
(``SeqWork.kv_format``).  Nothing downstream parses a preset again.

TurboQuant presets (``k<bits>[qjl]-?v<bits>``):

- ``k4v3`` (default): 4-bit keys, 3-bit values (MSE quantizer for both)
- ``k3qjl-v3``: keys as a 3-bit MSE code + a 1-bit QJL sketch of the residual (TurboQuant-prod with 4 bits
  in all; with the fp16 norm and residual norm 4.25 bits/dim at d = 128, SwiftLM's layout), 3-bit values
- ``k3v2``: aggressive; any ``kXvY`` / ``kXqjl-vY`` with 1 <= X, Y <= 4 is accepted as a custom preset

Options shared by all presets: ``window`` recent positions stay 16-bit, compression starts only once a
sequence holds more than ``threshold`` positions, and the first and last ``keep_layers`` layers keep a
16-bit cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

DEFAULT_PRESET = "k4v3"
NAMED_PRESETS = ("k4v3", "k3qjl-v3", "k3v2")
GROUP_SIZES = (32, 64, 128)
COMPRESS_BLOCK = 32  # dense rows beyond the window are compressed this many (or more) at a time
CODE_CAPACITY_STEP = 1024  # compressed storage grows in steps of this many positions (64 up to 1,024)

_PRESET = re.compile(r"^k([1-4])(qjl)?-?v([1-4])$")


@dataclass(frozen=True)
class KVFormat:
    kind: str = "fp16"  # "fp16" | "turbo" | "affine"
    key_bits: int = 16  # turbo: bits of the key's MSE code
    value_bits: int = 16
    key_qjl: bool = False  # turbo: plus one QJL residual-sign bit per coordinate
    window: int = 128
    threshold: int = 0
    keep_layers: int = 0
    group_size: int = 64  # affine
    seed: int = 0

    @property
    def name(self) -> str:
        if self.kind == "turbo":
            return f"k{self.key_bits}{'qjl-' if self.key_qjl else ''}v{self.value_bits}"
        if self.kind == "affine":
            return f"kv_bits={self.key_bits}/g{self.group_size}"
        return "fp16"

    @property
    def key_code_bits(self) -> int:
        """Bits per key coordinate in all (MSE code + QJL sign): the prod quantizer's ``bits``."""
        return self.key_bits + (1 if self.key_qjl else 0)

    @property
    def compressed(self) -> bool:
        return self.kind != "fp16"

    def layer_compressed(self, layer: int, layers: int) -> bool:
        k = self.keep_layers
        return self.kind == "turbo" and not (layer < k or layer >= layers - k)

    # ----------------------------------------------------------------- byte formulas
    def key_row_bytes(self, d: int) -> int:
        """Bytes of one compressed key row of one head (codes + fp16 norm [+ QJL signs + fp16 residual norm])."""
        if self.key_qjl:
            return d * self.key_bits // 8 + 2 + d // 8 + 2
        return d * self.key_bits // 8 + 2

    def value_row_bytes(self, d: int) -> int:
        return d * self.value_bits // 8 + 2

    def bits_per_dim(self, d: int) -> tuple[float, float]:
        return self.key_row_bytes(d) * 8 / d, self.value_row_bytes(d) * 8 / d


def parse_turbo(
    preset: str | None, *, window: int = 128, threshold: int = 0, keep_layers: int = 0, seed: int = 0
) -> KVFormat:
    """'default' / None -> k4v3; 'off' / 'none' / 'fp16' -> the 16-bit format; raises ValueError."""
    p = (preset or "default").strip().lower()
    if p in ("off", "none", "fp16", "16", "16-bit"):
        return KVFormat()
    if p in ("default", "on", "true", "1"):
        p = DEFAULT_PRESET
    m = _PRESET.match(p)
    if not m:
        raise ValueError(
            f"unknown TurboQuant preset {preset!r}: use {', '.join(NAMED_PRESETS)}, kXvY or kXqjl-vY "
            "(X, Y in 1..4), or 'off'"
        )
    kb, qjl, vb = int(m.group(1)), bool(m.group(2)), int(m.group(3))
    if window < 0 or threshold < 0 or keep_layers < 0:
        raise ValueError("window, threshold and keep_layers must be >= 0")
    return KVFormat("turbo", kb, vb, qjl, window=window, threshold=threshold, keep_layers=keep_layers, seed=seed)


def affine(bits: int, group_size: int = 64) -> KVFormat:
    if bits not in (4, 8):
        raise ValueError("kv_bits must be 4 or 8")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {GROUP_SIZES}")
    return KVFormat("affine", bits, bits, group_size=group_size, window=0)


def effective_group(head_dim: int, group: int) -> int | None:
    """The affine group size used for a head dim: the requested one if it divides the head dim, else the
    largest of GROUP_SIZES that does (e.g. 32 for head_dim 32), else None."""
    if head_dim % group == 0:
        return group
    fits = [g for g in GROUP_SIZES if head_dim % g == 0]
    return max(fits) if fits else None


def with_options(fmt: KVFormat, **kw: int) -> KVFormat:
    return replace(fmt, **kw)


def dense_capacity(fmt: KVFormat, n_dense: int) -> int:
    """Rows the 16-bit part of a compressed layer holds storage for: at least window + one
    compression block, else the rows present rounded up to a block."""
    need = -(-n_dense // COMPRESS_BLOCK) * COMPRESS_BLOCK
    return max(fmt.window + COMPRESS_BLOCK, need)


def code_capacity(n_code: int) -> int:
    """Rows of code storage allocated for ``n_code`` compressed positions: steps of 64 up to 1,024 (short
    sequences must not pay for 1,024 rows), then steps of CODE_CAPACITY_STEP."""
    step = 64 if n_code <= CODE_CAPACITY_STEP else CODE_CAPACITY_STEP
    return -(-n_code // step) * step


def turbo_layout_bytes(
    fmt: KVFormat, *, n_code: int, n_dense: int, layers: int, kv_heads: int, head_dim: int, dense_bytes: int = 2
) -> dict[str, int]:
    """Storage of a TurboQuant cache holding ``n_code`` compressed and ``n_dense`` 16-bit positions
    per compressed layer, by the layout rules (what the cache's tensors must add up to): compressed
    rows allocated in steps of CODE_CAPACITY_STEP positions (codes, fp16 norms, QJL signs and
    residual norms; see ``code_capacity``), the 16-bit part per ``dense_capacity``, layers kept 16-bit at exactly
    ``n_code + n_dense`` positions each."""
    d = head_dim
    comp_layers = sum(fmt.layer_compressed(i, layers) for i in range(layers))
    per_row = fmt.key_row_bytes(d) + fmt.value_row_bytes(d)
    dense_row = 2 * d * dense_bytes
    return {
        "codes_allocated": comp_layers * kv_heads * code_capacity(n_code) * per_row,
        "codes_used": comp_layers * kv_heads * n_code * per_row,
        "dense_allocated": comp_layers * kv_heads * dense_capacity(fmt, n_dense) * dense_row,
        "dense_used": comp_layers * kv_heads * n_dense * dense_row,
        "uncompressed_layers": (layers - comp_layers) * kv_heads * (n_code + n_dense) * dense_row,
    }


def settings_format(cfg: object | None) -> KVFormat:
    """The server-wide default format from Settings (``--turbo-kv [PRESET]`` and its options)."""
    if cfg is None or getattr(cfg, "turbo_kv", None) in (None, False):
        return KVFormat(window=int(getattr(cfg, "turbo_kv_window", 128) or 0) if cfg is not None else 128)
    return parse_turbo(
        str(cfg.turbo_kv),
        window=int(cfg.turbo_kv_window),
        threshold=int(cfg.turbo_kv_threshold),
        keep_layers=int(cfg.turbo_kv_keep_layers),
    )


class KVFieldError(ValueError):
    """A request's KV-cache field that does not parse; ``param`` names the field."""

    def __init__(self, param: str, msg: str):
        super().__init__(f"'{param}' {msg}")
        self.param, self.msg = param, msg


def request_override(turbo_kv: object, kv_bits: object, kv_group_size: object) -> KVFormat | None:
    """The one parser of a request's KV-cache fields (``turbo_kv``, ``kv_bits``, ``kv_group_size``): the
    format they ask for, or None when they ask for none (the served model's default).  A TurboQuant
    preset comes with the default options here; ``admitted_format`` gives it the served model's.
    Raises ``KVFieldError`` naming the field."""
    if kv_bits is not None:
        if isinstance(kv_bits, bool) or kv_bits not in (4, 8):
            raise KVFieldError("kv_bits", f"must be 4 or 8, got {kv_bits!r}")
        if turbo_kv not in (None, "off", "none"):
            raise KVFieldError("kv_bits", "cannot be combined with turbo_kv: choose one KV-cache format")
    if isinstance(kv_group_size, bool) or kv_group_size not in GROUP_SIZES:
        raise KVFieldError("kv_group_size", f"must be one of {list(GROUP_SIZES)}, got {kv_group_size!r}")
    if kv_bits:
        return affine(int(kv_bits), int(kv_group_size))  # type: ignore[call-overload]
    if turbo_kv is None:
        return None
    if not isinstance(turbo_kv, str):
        raise KVFieldError("turbo_kv", "must be a string: a preset name such as 'k4v3', or 'off'")
    try:
        return parse_turbo(turbo_kv)
    except ValueError as e:
        raise KVFieldError("turbo_kv", str(e)) from None


def admitted_format(override: KVFormat | None, default: KVFormat) -> KVFormat:
    """A request's KV format, decided once when it is admitted: its own (``request_override``; a
    TurboQuant preset takes the served model's window / threshold / keep-layers options), else the served
    model's ``default``."""
    if override is None:
        return default
    if override.kind == "turbo":
        return replace(override, window=default.window, threshold=default.threshold, keep_layers=default.keep_layers)
    return override
