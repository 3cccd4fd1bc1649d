"""Reference attention over TurboQuant-compressed history (numpy): the math that the MLX and
torch kernels must reproduce.

Keys and values of one head are stored as (fp16 norm, packed codes) after a rotation ``R``.
Because ``R`` is orthogonal, ``<q, k̂> = ‖k‖ <R q, c[codes]>``: the query is rotated once and
scored against centroids looked up from the codes, never materialising 16-bit keys.  Values are
averaged in the rotated domain (``Σ p_i ‖v_i‖ c[codes_i]``) and the sum is rotated back once.  The
most recent ``window`` positions stay in 16-bit and are attended to exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .quantizer import MSEEncoded, TurboQuantMSE


@dataclass
class CompressedHead:
    """One attention head's history: compressed rows followed by a 16-bit window."""

    kq: TurboQuantMSE
    vq: TurboQuantMSE
    window: int = 0
    keys: list[MSEEncoded] = field(default_factory=list)
    values: list[MSEEncoded] = field(default_factory=list)
    recent_k: np.ndarray | None = None  # [w, d] float16
    recent_v: np.ndarray | None = None

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Add positions ([n, d]); rows leaving the 16-bit window are compressed."""
        k16, v16 = np.asarray(k, np.float16), np.asarray(v, np.float16)
        rk = k16 if self.recent_k is None else np.concatenate([self.recent_k, k16])
        rv = v16 if self.recent_v is None else np.concatenate([self.recent_v, v16])
        spill = max(0, len(rk) - self.window)
        if spill:
            self.keys.append(self.kq.encode(rk[:spill].astype(np.float64)))
            self.values.append(self.vq.encode(rv[:spill].astype(np.float64)))
        self.recent_k, self.recent_v = rk[spill:], rv[spill:]

    def __len__(self) -> int:
        return sum(len(e.norms) for e in self.keys) + (0 if self.recent_k is None else len(self.recent_k))

    def nbytes(self) -> int:
        window = 0 if self.recent_k is None else self.recent_k.nbytes + self.recent_v.nbytes
        return sum(e.nbytes() for e in self.keys + self.values) + window

    def attend(self, q: np.ndarray, scale: float | None = None) -> np.ndarray:
        """softmax(q K^T * scale) V for one query [d], reading the compressed rows directly."""
        d = self.kq.d
        scale = d**-0.5 if scale is None else scale
        q = np.asarray(q, np.float64)
        q_rot = self.kq.rotation.forward(q)  # once per query
        scores = []
        for ek in self.keys:
            scores.append(ek.norms.astype(np.float64) * (self.kq.decode_unit(ek) @ q_rot))
        if self.recent_k is not None and len(self.recent_k):
            scores.append(self.recent_k.astype(np.float64) @ q)
        s = np.concatenate(scores) * scale if scores else np.zeros(0)
        p = np.exp(s - s.max())
        p /= p.sum()
        out_rot = np.zeros(d)
        i = 0
        for ev in self.values:  # the weighted sum stays in the rotated domain...
            n = len(ev.norms)
            out_rot += (p[i : i + n] * ev.norms.astype(np.float64)) @ self.vq.decode_unit(ev)
            i += n
        out = self.vq.rotation.inverse(out_rot)  # ...and is rotated back once
        if self.recent_v is not None and len(self.recent_v):
            out += p[i:] @ self.recent_v.astype(np.float64)
        return out

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """The full history decoded to float64 (for tests and the fallback path)."""
        ks = [self.kq.decode(e) for e in self.keys] + (
            [self.recent_k.astype(np.float64)] if self.recent_k is not None else []
        )
        vs = [self.vq.decode(e) for e in self.values] + (
            [self.recent_v.astype(np.float64)] if self.recent_v is not None else []
        )
        return np.concatenate(ks), np.concatenate(vs)
