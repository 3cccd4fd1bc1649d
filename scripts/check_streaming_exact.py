#!/usr/bin/env python3
"""Streamed vs resident experts on one checkpoint: logits of a prompt (5 and 80 tokens, and 8
decode steps) must be bit-identical.  Runs on whatever device the torch backend picks (the GPU
check of tests/test_expert_streaming.py, for machines without the test fixtures).

    python scripts/check_streaming_exact.py CKPT [--backend torch|mlx]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    a = ap.parse_args()
    import torch

    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    spec = resolve(a.ckpt)
    base = dict(
        expert_read_mode="pread",
        expert_read_threads=8,
        expert_prefetch=False,
        expert_top_k=0,
        mem_limit=None,
        ctx_size=512,
        parallel=1,
        turbo_kv=None,
    )
    res = load_model(spec, SimpleNamespace(stream_experts=False, **base))
    out = {"device": str(res.device), "dtype": str(res.dtype)}
    for mode in ("pread", "mmap"):
        st = load_model(spec, SimpleNamespace(stream_experts=True, **{**base, "expert_read_mode": mode}))
        ok = True
        for n in (5, 80):
            toks = torch.arange(3, 3 + n, device=res.device)
            with torch.no_grad():
                ca, cb = SeqCache(res.module.a, res.dtype, res.device), SeqCache(st.module.a, st.dtype, st.device)
                x = res.module(toks, ca, 0, last_only=False)
                y = st.module(toks, cb, 0, last_only=False)
                ok &= torch.equal(x, y)
                tok = int(x[-1].argmax())
                for i in range(8):  # decode steps
                    t = torch.tensor([tok], device=res.device)
                    x, y = res.module(t, ca, n + i), st.module(t, cb, n + i)
                    ok &= torch.equal(x, y)
                    tok = int(x[-1].argmax())
        out[f"{mode}_bit_identical"] = bool(ok)
    print(json.dumps(out))
    return 0 if all(v for k, v in out.items() if k.endswith("identical")) else 1


if __name__ == "__main__":
    sys.exit(main())
