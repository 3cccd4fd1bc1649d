"""Scratch requests through the step loop before a server takes its first request.

Some paths compile kernels or capture CUDA graphs the first time they run: on a GPU, a prompt's chunks after its
first (run eagerly) and a step that mixes prompt chunks with decode rows; with TurboQuant KV also the compressed
prompt pass and each batch size of compressed decode rows.  Under a first real load that costs seconds, and every stream of the step waits (measured on an H200, 8B
shape: 6 to 10 s steps on a machine's first run, 3 s with Triton's disk cache).  A model that has such paths says
so through ``ModelHooks.warm_up_waves``; the engine then runs each wave in turn, one request per length, admitted
at once, sampled (temperature 1, a fixed seed) with EOS ignored, the i-th of a wave stopping after
``TOKENS_PER_ROW * (i + 1)`` tokens, so that the batch shrinks one row at a time (every batch size is captured).
Sampled, not greedy: a greedy request takes the argmax and never reaches the sampler's Triton kernels, which then
compiled at a server's first sampled request (1.4 s on a fresh H200: bf16 rows of decode steps, float32 rows of
steps that mix prompt chunks with decode rows).
The requests are not counted: the engine's figures, step timers and prompt cache start empty afterwards.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

from .sampling import SamplingParams

TOKENS_PER_ROW = 8
FIRST_ID = 1 << 40  # the scratch requests' sequence ids: beyond any a caller hands out
_ids = itertools.count(FIRST_ID)


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (the model's output does not matter, only the shapes of the steps)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def warm_up(engine: Any, lengths: list[int], vocab: int, timeout: float = 600.0) -> float:
    """Run the scratch requests (``lengths`` prompt tokens each, all admitted at once) and wait for them; the
    engine's figures and prompt cache are reset once they have ended.  Returns the seconds taken.

    The requests enter as a request checked by another process does (``Intake.add_checked``, ids no caller
    hands out), and while they run the engine's step outputs go to this function instead of the output worker or
    the engine process's connections, which never hear of them."""
    t0 = time.perf_counter()
    outs = [TOKENS_PER_ROW * (i + 1) for i in range(len(lengths))]
    if engine.ctx_size:  # each request within the context
        lengths = [max(1, min(n, engine.ctx_size - k - 1)) for n, k in zip(lengths, outs)]
    ids = [next(_ids) for _ in lengths]
    ended: set[int] = set()
    errors: list[str] = []
    done, was_reset = threading.Event(), threading.Event()

    def collect(step_outs: list, dropped: list[int]) -> None:  # on the engine thread, between steps
        errors.extend(o.error for o in step_outs if o.error)
        ended.update(dropped)
        if ended.issuperset(ids):
            done.set()

    def reset() -> None:  # on the engine thread, after the last step's figures (the engine's only writer)
        engine.stats.reset()
        engine.timers.reset()
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()
        was_reset.set()

    with engine.outputs_to(collect):
        with engine.together():
            for sid, toks, k in zip(ids, prompts(lengths, vocab), outs):
                params = SamplingParams(max_tokens=k, temperature=1.0, seed=0, ignore_eos=True)
                engine.intake.add_checked(sid, toks, params, None, time.perf_counter())
        if not done.wait(timeout):
            raise RuntimeError("start-up warm-up requests did not end")
        engine.call_between_steps(reset)
        if not was_reset.wait(timeout):
            raise RuntimeError("the engine did not reset its figures after the start-up warm-up")
    if errors:
        raise RuntimeError(f"start-up warm-up request failed: {errors[0]}")
    return time.perf_counter() - t0
