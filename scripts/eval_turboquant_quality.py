#!/usr/bin/env python3
"""Quality of compressed KV caches on SmolLM2, through the caches the server uses.

    python scripts/eval_turboquant_quality.py [--tokens 4096] [--window 128] [--chunk 64]

Text: the Python documentation shipped in the standard library (``pydoc_data.topics``).  The model
(torch, fp32) reads it teacher-forced in chunks of ``--chunk`` tokens with the torch backend's
``CompressedCache`` (exactly what a request with that format gets: 16-bit rows kept in fp16 on CPU,
rows beyond the window compressed in blocks once the window + 32 rows are held, attention over
the packed codes), against the plain fp32 cache.

Per format: perplexity, its change against the uncompressed cache, mean KL(uncompressed || compressed)
of the next-token distributions, top-1 agreement, and the KV bytes held at the end against a 16-bit
cache of the same length.  Formats: TurboQuant presets (``kXvY``, ``kXqjl-vY``) and affine group
quantization (``kv_bits=4`` / ``kv_bits=8``, group 64: the torch twin of MLX's quantized cache).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def text_tokens(tok, n: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n + 1:
        raise SystemExit(f"only {len(ids)} tokens of text")
    return ids[: n + 1]


def make_format(preset: str, window: int, keep: int = 0):
    from swiftlm.turboquant.presets import affine, parse_turbo

    if preset.startswith("kv_bits"):
        return affine(int(preset.split("=")[1]), 64)
    name, _, rest = preset.partition("+keep")
    return parse_turbo(name, window=window, keep_layers=int(rest or keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--presets", default="k4v4,k4v3,k3qjl-v3,k3v3,k3v2,k4v3+keep1,kv_bits=8,kv_bits=4")
    ap.add_argument("--json", default="bench_results/eval_turboquant_quality.json")
    a = ap.parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    from swiftlm import LLM
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.backends.torch.kv_cache import SeqCache

    torch.set_grad_enabled(False)
    llm = LLM(backend="torch")
    m = llm.engine.model.module
    ids = text_tokens(llm.tokenizer, a.tokens)
    x, y = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    cpu = torch.device("cpu")

    def run(fmt) -> tuple[list[torch.Tensor], float, int]:
        cache = (
            SeqCache(m.a, torch.float32, cpu)
            if fmt is None
            else CompressedCache(m.a, fmt, torch.float32, cpu, dense_dtype=torch.float16)
        )
        out = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, len(x), a.chunk):
                logits = m(x[s : s + a.chunk], cache, s, last_only=False)
                out.append(torch.log_softmax(logits.float(), dim=-1))
        held = cache.nbytes() if fmt is not None else 0
        return out, time.perf_counter() - t0, held

    base, base_s, _ = run(None)
    base_lp = torch.cat(base)
    nll0 = -base_lp[torch.arange(len(y)), y].mean().item()
    fp16_bytes = 2 * m.a.layers * m.a.kv_heads * m.a.head_dim * 2 * len(x)
    rows = [
        {
            "preset": "uncompressed",
            "ppl": math.exp(nll0),
            "ppl_delta": 0.0,
            "kl": 0.0,
            "top1": 1.0,
            "seconds": base_s,
            "kv_bytes": fp16_bytes,
            "vs_16bit": 1.0,
        }
    ]
    for preset in a.presets.split(","):
        fmt = make_format(preset, a.window)
        lp, secs, held = run(fmt)
        lp = torch.cat(lp)
        nll = -lp[torch.arange(len(y)), y].mean().item()
        kl = (base_lp.exp() * (base_lp - lp)).sum(-1).mean().item()
        top1 = (base_lp.argmax(-1) == lp.argmax(-1)).float().mean().item()
        rows.append(
            {
                "preset": preset,
                "ppl": math.exp(nll),
                "ppl_delta": math.exp(nll) / math.exp(nll0) - 1,
                "kl": kl,
                "top1": top1,
                "seconds": secs,
                "kv_bytes": held,
                "vs_16bit": held / fp16_bytes,
                "bits_per_dim": fmt.bits_per_dim(m.a.head_dim) if fmt.kind == "turbo" else None,
            }
        )
        print(rows[-1], flush=True)
    t = Table(
        title=f"compressed KV quality, SmolLM2-135M (head_dim {m.a.head_dim}), {a.tokens} tokens of "
        f"pydoc text, TurboQuant window {a.window}, chunks of {a.chunk}, {platform.machine()}"
    )
    for col in ("format", "perplexity", "vs uncompressed", "mean KL", "top-1 agreement", "KV bytes vs 16-bit"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            r["preset"],
            f"{r['ppl']:.3f}",
            f"{r['ppl_delta']:+.2%}",
            f"{r['kl']:.4f}",
            f"{r['top1']:.2%}",
            f"{r['vs_16bit']:.3f}x",
        )
    Console().print(t)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps(
            {"tokens": a.tokens, "window": a.window, "chunk": a.chunk, "head_dim": m.a.head_dim, "rows": rows}, indent=2
        )
    )
    llm.close()


if __name__ == "__main__":
    main()
