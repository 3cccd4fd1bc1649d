"""Scratch requests through the step loop before a server takes its first request.

Some paths compile kernels or capture CUDA graphs the first time they run: with TurboQuant KV on a GPU, the
compressed prompt pass, a step that mixes prompt chunks with decode rows, and each batch size of compressed decode
rows.  Under a first real load that costs seconds, and every stream of the step waits (measured on an H200, 8B
shape: 6 to 10 s steps on a machine's first run, 3 s with Triton's disk cache).  A model that has such paths says
so through ``ModelHooks.warm_up_lengths``; the engine then runs one request per length at once, greedy with EOS
banned, the i-th stopping after ``TOKENS_PER_ROW * (i + 1)`` tokens, so that the batch shrinks one row at a time
(every batch size is captured) while the long first prompt is still prefilling beside the others' decode rows.
The requests are not counted: the engine's figures and prompt cache start empty afterwards.
"""

from __future__ import annotations

import random
import time
from typing import Any

from .outputs import SyncSink
from .sampling import SamplingParams

TOKENS_PER_ROW = 8


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (the model's output does not matter, only the shapes of the steps)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def warm_up(engine: Any, lengths: list[int], vocab: int, timeout: float = 600.0) -> float:
    """Run the scratch requests (``lengths`` prompt tokens each, all submitted at once) and wait for them;
    then reset the engine's figures and prompt cache.  Returns the seconds taken."""
    t0 = time.perf_counter()
    sinks = [SyncSink() for _ in lengths]
    outs = [TOKENS_PER_ROW * (i + 1) for i in range(len(lengths))]
    if engine.ctx_size:  # each request within the context
        lengths = [max(1, min(n, engine.ctx_size - k - 1)) for n, k in zip(lengths, outs)]
    with engine.together():
        for toks, k, sink in zip(prompts(lengths, vocab), outs, sinks):
            engine.submit(toks, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True), sink)
    for sink in sinks:
        for ev in sink:
            if ev.error:
                raise RuntimeError(f"start-up warm-up request failed: {ev.error}")
    deadline = time.perf_counter() + timeout
    while engine.live_requests or engine.stats.requests_active:  # the loop's bookkeeping after the last event
        if time.perf_counter() > deadline:
            raise RuntimeError("start-up warm-up requests did not end")
        time.sleep(0.005)
    engine.stats.reset()
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    return time.perf_counter() - t0
