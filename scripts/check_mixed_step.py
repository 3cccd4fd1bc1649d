#!/usr/bin/env python3
"""The mixed prompt + decode step on a GPU (backends/torch/mixed_step.py) against the two forwards it replaces.

    python scripts/check_mixed_step.py --model DIR [--json out.json]

Two slot pools get the same history (old prompts prefilled); then one runs the new prompts' packed prefill and the
old sequences' batched decode step (the fused graph's step function, eager), the other the mixed step replayed
from its CUDA graph.  Prints, per decode batch size, the largest logit difference relative to the logits' range,
the fraction of rows whose argmax agrees and the largest KV difference (bf16: the shared matmuls have more rows,
so within rounding, not equal).
"""

from __future__ import annotations

import torch
from _gpu_check_common import Check, parse_args, run


def main() -> None:
    a = parse_args(__doc__)
    from swiftlm.backends.torch.graphs import SlotPool, prefill_packed_static
    from swiftlm.backends.torch.packed_attention import cu_seqlens, pack, prefill_attention
    from swiftlm.backends.torch.prefill_graphs import PackedGraphs

    check = Check(a.model, parallel=16, ctx_size=1024)
    tm = check.tm
    m, dec = tm.module, tm.graphs
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)

    def prefill(pool, prompts, slots):
        toks, sl, pos, seg, last = pack(prompts, slots)
        cu = cu_seqlens([len(p) for p in prompts]).to(dev)
        with prefill_attention(dev, len(toks)):
            return prefill_packed_static(
                m,
                pool,
                *(torch.tensor(x, device=dev) for x in (toks, sl, pos, seg, last)),
                cu,
                max(len(p) for p in prompts),
            )

    with torch.inference_mode():
        for B in (1, 5, 16):
            old = [
                torch.randint(0, m.a.vocab, (int(n),), generator=g).tolist()
                for n in torch.randint(20, 90, (B,), generator=g)
            ]
            new = [torch.randint(0, m.a.vocab, (int(n),), generator=g).tolist() for n in (70, 33, 51)]
            old_slots, new_slots = list(range(B)), list(range(B, B + 3))
            nxt = torch.randint(0, m.a.vocab, (B,), generator=g).tolist()
            pools = [SlotPool(m.a, 32, 1024, tm.dtype, dev) for _ in range(2)]
            for pool in pools:
                prefill(pool, old, old_slots)
            want_p = prefill(pools[0], new, new_slots).float()
            L = pools[0].capacity
            want_d = dec.batch_fn(
                m,
                pools[0],
                torch.tensor(nxt, device=dev),
                torch.tensor(old_slots, device=dev),
                torch.tensor([len(p) for p in old], device=dev),
                L,
                dec.arange,
                dec.splits_for(L, B),
            ).float()
            mg = PackedGraphs(dec, pools[1], rows=pools[1].n)
            got_p, got_d = mg.run(*pack(new, new_slots), nxt, old_slots, [len(p) for p in old])
            torch.cuda.synchronize()
            row = {"decode_rows": B, "prompts": len(new), "graphed": dec.use_graph}
            for name, got, want in (("prompts", got_p, want_p), ("decode", got_d, want_d)):
                span = float(want.max() - want.min())
                row[name] = {
                    "max_diff_rel": round(float((got - want).abs().max()) / span, 5),
                    "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
                }
            kv = max(
                float((pools[1].k[i][: B + 3, :, :100] - pools[0].k[i][: B + 3, :, :100]).abs().max())
                for i in range(m.a.layers)
            )
            row["kv_max_diff"] = kv
            check.row(row)
    check.finish(a.json)


if __name__ == "__main__":
    run(main)
