#!/usr/bin/env python3
"""The packed prefill on a GPU: the variable-length flash attention against masked SDPA, and the captured
(graphed) chunk against the eager one.

    python scripts/check_packed_prefill.py --model DIR [--prompt-tokens 40] [--json out.json]

For chunks of P-token prompts packed to T tokens (T = 40 ... 2560): each variant's last-token logits
against the per-prompt forward of the model (``Transformer.__call__`` on a fresh cache: SDPA causal,
one prompt at a time), as the largest difference relative to the logits' range and the fraction of
prompts whose argmax agrees (bf16: the packed matmuls sum in another order, so within rounding, not
equal); then each variant's time per chunk (CUDA events, the median of 20 after 3 warm-ups).
"""

from __future__ import annotations

import statistics

import torch
from _gpu_check_common import Check, parse_args, run


def main() -> None:
    a = parse_args(
        __doc__,
        ("--prompt-tokens", {"type": int, "default": 40}),
        ("--totals", {"default": "40,80,320,480,640,1280,2560"}),
    )
    from swiftlm.backends.torch.graphs import prefill_packed_static
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.packed_attention import cu_seqlens, pack
    from swiftlm.backends.torch.prefill_graphs import PackedGraphs
    from swiftlm.backends.torch.runner import prefill_attention

    dev = torch.device("cuda")
    check = Check(a.model, parallel=64, ctx_size=4096, prompt_tokens=a.prompt_tokens)
    tm = check.tm
    m, pool = tm.module, tm.pool
    g = torch.Generator().manual_seed(0)

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
            pg = PackedGraphs(tm.graphs, pool)
            if pg.fits(len(toks), n):
                variants["graph"] = lambda: pg.run(toks, sl, pos, seg, last)[0]
            row = {"prompts": n, "tokens": len(toks)}
            for name, fn in variants.items():
                got = fn()[: len(ref)].float()
                span = float(ref_t.max() - ref_t.min())
                row[name] = {
                    "max_diff_rel": round(float((got - ref_t).abs().max()) / span, 5),
                    "argmax_agree": float((got.argmax(-1) == ref_t.argmax(-1)).float().mean()),
                    "ms": timed(fn),
                }
            check.row(row)
    check.finish(a.json)


if __name__ == "__main__":
    run(main)
