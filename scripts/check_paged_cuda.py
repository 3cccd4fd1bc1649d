"""The paged KV pool on a GPU: greedy outputs across block layouts, under forced preemption and
with prefix caching, through the Python API (the served engine's step loop, CUDA graphs on).

    python scripts/check_paged_cuda.py --model /tmp/m1b --json out.json

Runs, each on a fresh engine, N greedy requests at once (``--parallel`` N, EOS banned):
- ``slots``: one block per sequence (``--kv-block-size`` = the context: a slot pool's layout);
- ``slots_again``: the same once more (is the engine deterministic from run to run?);
- ``bs64`` / ``bs32`` / ``bs16``: 64-, 32- and 16-position blocks (64 is the default);
- ``preempt``: 16-position blocks in a pool that holds about a third of what the sequences need, so the
  newest are preempted and recomputed;
- ``prefix``: requests sharing a long first part, one after the other, so later ones start from cached
  blocks (``cached_tokens``);
- ``ngram``: n-gram speculation (verification through the block table) against plain decoding, one stream.
Prints and writes, per run: the fraction of requests whose tokens equal the ``slots`` run's (and the first
differing position where not), preemptions, cached tokens, seconds.  bf16 sums in a different batch
composition (preemption) may round differently: that run reports a fraction, not an assertion.
"""

from __future__ import annotations

import argparse
import json
import time


def run(model: str, prompts: list[list[int]], max_tokens: int, **kw) -> dict:
    from swiftlm import LLM, SamplingParams

    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    with LLM(model, backend="torch", **kw) as llm:
        t1 = time.perf_counter()
        outs = llm.generate(prompts, p)
        t2 = time.perf_counter()
        eng = llm.engine
        blocks = eng.kv_blocks.stats() if eng.kv_blocks is not None else None
        return {
            "tokens": [o.token_ids for o in outs],
            "cached": [o.usage["cached_tokens"] for o in outs],
            "preemptions": eng.scheduler.preemptions,
            "blocks": blocks,
            "load_s": round(t1 - t0, 2),
            "generate_s": round(t2 - t1, 2),
            "kw": {k: v for k, v in kw.items()},
        }


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = [a == b for a, b in zip(ref, got)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ref, got)]
    return {"equal": sum(same), "of": len(same), "first_difference": [f for f in first if f is not None]}


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def word_prompts(model: str, ctx: int, lengths: list[int], step: int = 3) -> list[list[int]]:
    """Token ids of prompts of ``lengths`` words each, prompt i cycling through WORDS from word ``step * i``."""
    from swiftlm import LLM

    with LLM(model, backend="torch", ctx_size=ctx) as tmp:
        enc = tmp.engine.text_prompt
        return [enc(" ".join(WORDS[(i * step + j) % len(WORDS)] for j in range(n))) for i, n in enumerate(lengths)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()
    from swiftlm import LLM

    with LLM(a.model, backend="torch", ctx_size=a.ctx) as tmp:
        enc = tmp.engine.text_prompt
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
        prompts = [enc(" ".join(words[(i * 3 + j) % len(words)] for j in range(8 + 5 * i))) for i in range(a.n)]
        shared = enc("You are a careful assistant. Answer in one short line. " * 12)
        prefixed = [shared + enc(f" Question {i}: what comes after {words[i % len(words)]}?") for i in range(6)]
    base = {"ctx_size": a.ctx, "parallel": a.n, "prompt_cache_bytes": 0}
    res: dict = {}
    res["slots"] = run(a.model, prompts, a.max_tokens, kv_block_size=a.ctx, **base)
    ref = res["slots"]["tokens"]
    res["slots_again"] = run(a.model, prompts, a.max_tokens, kv_block_size=a.ctx, **base)  # run to run
    for bs in (64, 32, 16):
        res[f"bs{bs}"] = run(a.model, prompts, a.max_tokens, kv_block_size=bs, **base)
    # positions the n sequences need together at the end, and a pool of a third of that (>= one context)
    need = sum(len(p) + a.max_tokens + 1 for p in prompts)
    per_tok = None
    with LLM(a.model, backend="torch", ctx_size=a.ctx) as tmp:
        per_tok = tmp.engine.info.kv_bytes_per_token
    mem = max(need // 3, a.ctx + 16) * per_tok
    res["preempt"] = run(a.model, prompts, a.max_tokens, kv_block_size=16, kv_cache_memory=str(mem), **base)
    for name in ("slots_again", "bs64", "bs32", "bs16", "preempt"):
        res[name]["vs_slots"] = compare(ref, res[name]["tokens"])
    # prefix caching: one request at a time (the prompt cache setting switches block prefix caching on)
    pc = {"ctx_size": a.ctx, "parallel": 4, "prompt_cache_bytes": 1 << 30}
    seq = []
    from swiftlm import SamplingParams

    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with LLM(a.model, backend="torch", kv_block_size=a.ctx, **{**pc, "prompt_cache_bytes": 0}) as llm:
        want = [llm.generate(q, p).token_ids for q in prefixed]
    with LLM(a.model, backend="torch", **pc) as llm:
        for q in prefixed:
            o = llm.generate(q, p)
            seq.append((o.token_ids, o.usage["cached_tokens"]))
        res["prefix"] = {
            "cached": [c for _, c in seq],
            "prompt_tokens": [len(q) for q in prefixed],
            "vs_uncached": compare(want, [t for t, _ in seq]),
            "blocks": llm.engine.kv_blocks.stats(),
        }
    # n-gram speculation over the paged pool (verification writes through the table): a copy-heavy prompt, one
    # stream, against plain decoding of the same prompt
    rep = enc("one two three four five six seven eight nine ten " * 6)
    res["ngram"] = run(a.model, [rep], a.max_tokens, speculative="ngram", **{**base, "parallel": 1})
    plain = run(a.model, [rep], a.max_tokens, **{**base, "parallel": 1})
    res["ngram"]["vs_plain"] = compare(plain["tokens"], res["ngram"]["tokens"])
    for name, r in res.items():
        show = {k: v for k, v in r.items() if k not in ("tokens",)}
        print(name, json.dumps(show))
    if a.json:
        json.dump(
            {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in res.items()}, open(a.json, "w"), indent=1
        )


if __name__ == "__main__":
    main()
