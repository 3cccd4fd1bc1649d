#!/usr/bin/env python3
"""Quality of compressed KV caches on SmolLM2, measured before the cache itself exists.

    python scripts/eval_turboquant_quality.py [--tokens 4096] [--window 128] [--chunk 64]

Text: the Python documentation shipped in the standard library (``pydoc_data.topics``).  The model
(torch, fp32) reads it teacher-forced in chunks; after each chunk, every cached key/value row older
than the 16-bit window is replaced by its quantize -> dequantize round trip, so later tokens attend
to exactly what a compressed cache would return (attention over TurboQuant codes equals attention
over the dequantized rows: ``tests/test_turboquant.py``).  Rows inside a chunk attend to each other
in 16-bit, so the effective window is ``--window`` to ``--window + --chunk - 1`` tokens.

Per preset: perplexity, its change against the 16-bit cache, mean KL(16-bit || compressed) of the
next-token distributions, and top-1 agreement.  Presets: TurboQuant-mse keys/values (``kXvY``) and
MLX-style affine group quantization (``kv_bits`` 4 and 8, group 64).  The QJL variant (``k3qjl-v3``)
scores keys with an estimator rather than dequantized rows, so it needs the real attention path and is
not simulated here.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def text_tokens(tok, n: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n + 1:
        raise SystemExit(f"only {len(ids)} tokens of text")
    return ids[: n + 1]


def group_quant(x: np.ndarray, bits: int, group: int = 64) -> np.ndarray:
    """MLX-style affine quantization along the last axis in groups (scale and bias per group)."""
    shp = x.shape
    g = x.reshape(-1, group)
    lo, hi = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / (2 ** bits - 1), 1.0)
    q = np.clip(np.round((g - lo) / scale), 0, 2 ** bits - 1)
    return (q * scale + lo).reshape(shp)


def make_roundtrip(preset: str, d: int):
    from swiftlm.turboquant import TurboQuantMSE

    if preset.startswith("kv_bits"):
        bits = int(preset.split("=")[1])
        f = lambda x: group_quant(x, bits, min(64, d))  # noqa: E731
        return f, f
    kb, vb = int(preset[1]), int(preset[3])
    kq, vq = TurboQuantMSE(d, kb, seed=1), TurboQuantMSE(d, vb, seed=2)
    return (lambda x: kq.decode(kq.encode(x))), (lambda x: vq.decode(vq.encode(x)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--presets", default="k4v4,k4v3,k3v3,k3v2,kv_bits=8,kv_bits=4")
    ap.add_argument("--json", default="bench_results/eval_turboquant_quality.json")
    a = ap.parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    from swiftlm import LLM
    from swiftlm.backends.torch.model import SeqCache

    torch.set_grad_enabled(False)
    llm = LLM(backend="torch")
    m = llm.engine.model.module
    ids = text_tokens(llm.tokenizer, a.tokens)
    x, y = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    cpu = torch.device("cpu")

    def run(roundtrip) -> tuple[list[torch.Tensor], float]:
        cache = SeqCache(m.a, torch.float32, cpu)
        done = 0
        out = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, len(x), a.chunk):
                logits = m(x[s:s + a.chunk], cache, s, last_only=False)
                out.append(torch.log_softmax(logits.float(), dim=-1))
                end = cache.length - a.window
                if roundtrip is not None and end > done:
                    fk, fv = roundtrip
                    for layer in range(m.a.layers):
                        for store, f in ((cache.k, fk), (cache.v, fv)):
                            rows = store[layer][:, done:end].numpy().astype(np.float64)  # [KVH, n, D]
                            store[layer][:, done:end] = torch.from_numpy(f(rows.reshape(-1, rows.shape[-1]))
                                                                         .reshape(rows.shape).astype(np.float32))
                    done = end
        return out, time.perf_counter() - t0

    base, base_s = run(None)
    base_lp = torch.cat(base)
    nll0 = -base_lp[torch.arange(len(y)), y].mean().item()
    rows = [{"preset": "16-bit", "ppl": math.exp(nll0), "ppl_delta": 0.0, "kl": 0.0, "top1": 1.0,
             "seconds": base_s}]
    for preset in a.presets.split(","):
        lp, secs = run(make_roundtrip(preset, m.a.head_dim))
        lp = torch.cat(lp)
        nll = -lp[torch.arange(len(y)), y].mean().item()
        kl = (base_lp.exp() * (base_lp - lp)).sum(-1).mean().item()
        top1 = (base_lp.argmax(-1) == lp.argmax(-1)).float().mean().item()
        rows.append({"preset": preset, "ppl": math.exp(nll), "ppl_delta": math.exp(nll) / math.exp(nll0) - 1,
                     "kl": kl, "top1": top1, "seconds": secs})
    t = Table(title=f"compressed KV quality, SmolLM2-135M (head_dim {m.a.head_dim}), {a.tokens} tokens of "
                    f"pydoc text, 16-bit window {a.window}, chunks of {a.chunk}, {platform.machine()}")
    for col in ("preset", "perplexity", "vs 16-bit", "mean KL", "top-1 agreement"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["preset"], f"{r['ppl']:.3f}", f"{r['ppl_delta']:+.2%}", f"{r['kl']:.4f}", f"{r['top1']:.2%}")
    Console().print(t)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"tokens": a.tokens, "window": a.window, "chunk": a.chunk,
                                        "head_dim": m.a.head_dim, "rows": rows}, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
