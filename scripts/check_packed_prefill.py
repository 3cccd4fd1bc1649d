#!/usr/bin/env python3
"""The packed prefill on a GPU (issue 18): the variable-length flash attention against the masked SDPA
it replaced, and the captured (graphed) chunk against the eager one.

    python scripts/check_packed_prefill.py --model DIR [--prompt-tokens 40] [--json out.json]

For chunks of P-token prompts packed to T tokens (T = 40 ... 2560): each variant's last-token logits
against the per-prompt forward of the model (``Transformer.__call__`` on a fresh cache: SDPA causal,
one prompt at a time), as the largest difference relative to the logits' range and the fraction of
prompts whose argmax agrees (bf16: the packed matmuls sum in another order, so within rounding, not
equal); then each variant's time per chunk (CUDA events, the median of 20 after 3 warm-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--totals", default="40,80,320,480,640,1280,2560")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from swiftlm.backends.torch.graphs import prefill_packed_static
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.packed_attention import cu_seqlens, pack
    from swiftlm.backends.torch.prefill_graphs import PrefillGraphs
    from swiftlm.backends.torch.runner import prefill_attention

    dev = torch.device("cuda")
    from swiftlm import LLM

    llm = LLM(a.model, backend="torch", parallel=64, prompt_cache_bytes=0, ctx_size=4096)
    tm = llm.engine.model
    m, pool = tm.module, tm.pool
    g = torch.Generator().manual_seed(0)
    out: dict = {"model": a.model, "device": torch.cuda.get_device_name(), "prompt_tokens": a.prompt_tokens,
                 "rows": []}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return round(statistics.median(ts), 3)

    with torch.inference_mode():
        for total in (int(x) for x in a.totals.split(",")):
            n = max(1, total // a.prompt_tokens)
            prompts = [torch.randint(0, m.a.vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(n)]
            toks, sl, pos, seg, last = pack(prompts, [i % pool.n for i in range(n)])
            host = [torch.tensor(x, device=dev) for x in (toks, sl, pos, seg, last)]
            cu = cu_seqlens([len(p) for p in prompts]).to(dev)
            ref = []
            for p in prompts[:8]:
                c = SeqCache(m.a, tm.dtype, dev, capacity=256)
                with prefill_attention(dev, len(p)):
                    ref.append(m(torch.tensor(p, device=dev), c, 0)[-1].float())
            ref_t = torch.stack(ref)

            def masked():
                with prefill_attention(dev, len(toks)):
                    return prefill_packed_static(m, pool, *host)

            def varlen():
                with prefill_attention(dev, len(toks)):
                    return prefill_packed_static(m, pool, *host, cu, a.prompt_tokens)

            variants = {"masked": masked, "varlen": varlen}
            pg = PrefillGraphs(tm.graphs, pool)
            if pg.fits(len(toks), n):
                variants["graph"] = lambda: pg.run(toks, sl, pos, seg, last)
            row = {"prompts": n, "tokens": len(toks)}
            for name, fn in variants.items():
                got = fn()[:len(ref)].float()
                span = float(ref_t.max() - ref_t.min())
                row[name] = {"max_diff_rel": round(float((got - ref_t).abs().max()) / span, 5),
                             "argmax_agree": float((got.argmax(-1) == ref_t.argmax(-1)).float().mean()),
                             "ms": timed(fn)}
            print(row, flush=True)
            out["rows"].append(row)
    llm.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("SWIFTLM_ENGINE_PROCESS", "off")
    main()
