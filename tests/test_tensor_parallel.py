"""--tensor-parallel on the CPU: 2 ranks (gloo on localhost) against the single-process model.

The sharded model computes the same function; only the summation order of the split reductions
(o_proj over heads, down_proj over MLP columns, each summed across ranks by the all-reduce)
differs, so greedy tokens must be equal and first-step logits equal within fp32 rounding."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, make_ckpt, needs_torch, run_cli

pytestmark = needs_torch

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fibonacci(n):"]


def _greedy(n: int = 32):
    from swiftlm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def kv1_llama(tmp_path_factory) -> Path:
    """One KV head, four query heads: over 2 ranks each keeps a copy of the KV head."""
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "kv1",
        "--arch",
        "llama",
        "--dtype",
        "float32",
        "--heads",
        "4",
        "--kv-heads",
        "1",
        "--seed",
        "3",
    )


def _pair(model: str | None):
    from swiftlm import LLM

    single = LLM(model, backend="torch", parallel=4)
    tp = LLM(model, backend="torch", parallel=4, tensor_parallel=2)
    return single, tp


@pytest.fixture(scope="module")
def uneven_llama(tmp_path_factory) -> Path:
    """Nine query heads over three KV heads (SmolLM2's grouping) and 257 MLP columns: over 2 ranks one rank holds
    one KV group and the other two, and the MLP columns split 128/129."""
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "uneven",
        "--arch",
        "llama",
        "--dtype",
        "float32",
        "--hidden",
        "144",
        "--heads",
        "9",
        "--kv-heads",
        "3",
        "--head-dim",
        "16",
        "--intermediate",
        "257",
        "--seed",
        "4",
    )


@pytest.fixture(scope="module", params=["uneven", "tiny_llama", "kv1"])
def pair(request, tiny_llama, kv1_llama, uneven_llama):
    model = {"uneven": str(uneven_llama), "tiny_llama": str(tiny_llama), "kv1": str(kv1_llama)}[request.param]
    single, tp = _pair(model)
    yield request.param, single, tp
    tp.close()
    single.close()


def first_logits(llm, tokens: list[int]):
    """Rank 0's full-vocabulary logits of a one-chunk prefill (the engine is idle meanwhile)."""
    from swiftlm.backend import SeqWork, StepBatch
    from swiftlm.sampling import SamplerState, SamplingParams

    model = llm.engine.model
    sid = 10**6 + len(tokens)
    fwd = model.forward(StepBatch([SeqWork(sid, tokens, 0, True, SamplingParams(), SamplerState())]))
    model.free([sid])
    return fwd.logits[0].float()


def test_greedy_tokens_equal_single_process(pair):
    name, single, tp = pair
    for p in PROMPTS:
        want = single.generate(p, _greedy()).token_ids
        got = tp.generate(p, _greedy()).token_ids
        assert got == want, (name, p)


def test_batched_concurrent_requests_equal(pair):
    """Four prompts at once (prefill chunks and batched decode rows in one step) on 2 ranks."""
    name, single, tp = pair
    want = [single.generate(p, _greedy()).token_ids for p in PROMPTS]
    got = [o.token_ids for o in tp.generate(PROMPTS, _greedy())]
    assert got == want, name


def test_first_step_logits_within_fp32_rounding(pair):
    """Tolerance: the split reductions are re-associated sums of K <= max(hidden, heads*head_dim,
    intermediate) fp32 terms; each such sum may move by up to K * 2**-24 relative to the sum of its
    terms' magnitudes (the standard bound), and the L layers compound it at most additively, so the
    logits may differ by L * K * 2**-24 * max|logit|, a generous bound; the test fails on any real sharding
    error (a wrong slice moves logits by O(1))."""
    name, single, tp = pair
    a = single.engine.model.module.a
    K = max(a.hidden, a.heads * a.head_dim, a.intermediate)
    for p in PROMPTS[:2]:
        toks = single.engine.text_prompt(p)
        want, got = first_logits(single, toks), first_logits(tp, toks)
        assert got.shape == want.shape
        tol = a.layers * K * 2.0**-24 * float(want.abs().max())
        diff = float((got - want).abs().max())
        assert diff <= tol, (name, diff, tol)
        assert int(got.argmax()) == int(want.argmax())


def test_step_mixing_prefill_and_decode_rows(pair):
    """One forward holding two batched decode rows and a prefill chunk: every row's logits are the
    full vocabulary and equal the single process's (a prefill row gathered alone inside the step would
    stack rows of two widths and fail the rank; a `serve --tensor-parallel 2` mixes them whenever streams
    arrive while others decode).  Same tolerance as above."""
    from swiftlm.backend import SeqWork, StepBatch
    from swiftlm.sampling import SamplerState, SamplingParams

    name, single, tp = pair
    a = single.engine.model.module.a
    K = max(a.hidden, a.heads * a.head_dim, a.intermediate)
    toks = [single.engine.text_prompt(p) for p in PROMPTS[:3]]
    got = {}
    for key, llm in (("single", single), ("tp", tp)):
        model = llm.engine.model
        ids = [2 * 10**6 + i for i in range(3)]

        def work(sid, tokens, start):
            return SeqWork(sid, tokens, start, True, SamplingParams(), SamplerState())

        model.forward(StepBatch([work(ids[0], toks[0], 0), work(ids[1], toks[1], 0)]))
        fwd = model.forward(
            StepBatch(
                [
                    work(ids[0], [toks[0][-1]], len(toks[0])),
                    work(ids[1], [toks[1][-1]], len(toks[1])),
                    work(ids[2], toks[2], 0),
                ]
            )
        )
        model.free(ids)
        got[key] = fwd.logits.float()
    assert got["tp"].shape == got["single"].shape == (3, single.engine.model.info.vocab_size)
    tol = a.layers * K * 2.0**-24 * float(got["single"].abs().max())
    assert float((got["tp"] - got["single"]).abs().max()) <= tol, name


def test_prompt_cache_reuse_is_sharded(pair):
    """A repeated prompt restores its KV from the prompt cache on every rank (each rank keeps its
    own heads' rows under the key rank 0 hands out) and continues exactly as a fresh prefill.
    (One tensor-parallel model per process: this uses the module's.)"""
    name, single, tp = pair
    prompt = list(range(5, 45))
    first = tp.generate(prompt, _greedy(16))
    second = tp.generate(prompt, _greedy(16))
    assert second.usage["cached_tokens"] > 0, name
    assert second.token_ids == first.token_ids == single.generate(prompt, _greedy(16)).token_ids, name
    assert tp.engine.model.failed is None


def test_split_plan():
    from swiftlm.backends.torch.parallel import make_plan
    from swiftlm.errors import ConfigError

    cfg = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 1,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49153,
    }
    p0, p1 = make_plan(cfg, 0, 2), make_plan(cfg, 1, 2)  # SmolLM2's 9 heads in 3 KV groups: 1 group + 2
    assert (p0.q0, p0.q1, p0.kv0, p0.kv1, p1.q0, p1.q1, p1.kv0, p1.kv1) == (0, 3, 0, 1, 3, 9, 1, 3)
    assert p0.vocab_rows == p1.vocab_rows == 24577 and p1.v0 == 24577  # padded to equal slices
    one = dict(cfg, num_attention_heads=4, num_key_value_heads=1)
    assert [(make_plan(one, r, 2).q0, make_plan(one, r, 2).kv0, make_plan(one, r, 2).kv1) for r in (0, 1)] == [
        (0, 0, 1),
        (2, 0, 1),
    ]  # the KV head replicated
    with pytest.raises(ConfigError, match="--tensor-parallel"):
        make_plan(dict(cfg, num_attention_heads=6, num_key_value_heads=3), 1, 4)  # rank 1 would need 2 KV heads
    with pytest.raises(ConfigError, match="MoE"):
        make_plan(dict(cfg, num_experts=8, num_experts_per_tok=2), 0, 2)


def test_unsupported_combination_refused(tiny_llama):
    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--tensor-parallel",
        "2",
        "--turbo-kv",
        "--max-tokens",
        "2",
        "-p",
        "hi",
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--turbo-kv cannot be combined with --tensor-parallel" in r.stderr


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from swiftlm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], backend="torch", tensor_parallel=2)
        llm.generate("warm up", SamplingParams(max_tokens=4, temperature=0))
        (pid,) = [p.pid for p in llm.engine.model._procs.values()]
        def kill():
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
        t0 = time.time()
        try:  # a long generation: rank 0 is inside a step's collectives when rank 1 dies
            llm.generate("count", SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True))
            print("NO ERROR")
        except RuntimeError as exc:
            print("ERROR1", exc, flush=True)
        try:
            llm.generate("again", SamplingParams(max_tokens=4, temperature=0))
            print("NO ERROR")
        except Exception as exc:
            print("ERROR2", type(exc).__name__, exc, flush=True)
        print("SECONDS", round(time.time() - t0, 1), flush=True)
""")


def test_follower_killed_mid_generation_fails_cleanly(tiny_llama, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PY, str(script), str(tiny_llama)], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout
    assert r.returncode == 1, r.stderr[-3000:]  # a process that lost a rank exits 1 (control.Leader._fail)
    assert "NO ERROR" not in out
    assert "ERROR1" in out and "tensor-parallel rank 1" in out and "killed by signal 9" in out, out
    assert "ERROR2" in out and "tensor-parallel rank 1" in out.split("ERROR2")[1], out
    assert float(out.split("SECONDS")[1]) < 60


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _followers(pid: int) -> list[int]:
    """The spawned ranks among ``pid``'s descendants (under --engine-process on, the engine process's children)."""
    found, todo = [], _children(pid)
    while todo:
        k = todo.pop()
        try:
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                found.append(k)
            else:
                todo += _children(k)
        except FileNotFoundError:
            pass
    return found


def test_engine_process_rank0_greedy_equal_then_killed_rank_ends_streams(uneven_llama):
    """--engine-process on: rank 0 lives in the engine process and spawns rank 1 from there.  Greedy
    tokens equal the single-process model's; killing rank 1 mid-generation ends the stream with the error
    naming the rank, and later requests are refused with it."""
    from swiftlm import LLM, SamplingParams

    with LLM(str(uneven_llama), backend="torch", parallel=4) as single:
        want = [single.generate(p, _greedy()).token_ids for p in PROMPTS]
    with LLM(str(uneven_llama), backend="torch", parallel=4, tensor_parallel=2, engine_process="on") as tp:
        assert type(tp.engine).__name__ == "EngineClient" and set(tp.engine.rank_pids) == {1}
        assert [o.token_ids for o in tp.generate(PROMPTS, _greedy())] == want
        stream = tp.stream("count", SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True))
        next(stream)
        os.kill(tp.engine.rank_pids[1], signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 .*killed by signal 9"):
            for _ in stream:
                pass
        assert time.time() - t0 < 30
        with pytest.raises(Exception, match="tensor-parallel rank 1"):
            tp.generate("again", _greedy(4))


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_serve_tensor_parallel_http_then_rank_death_stops_server(tiny_llama, engine_process):
    """`swiftlm serve --tensor-parallel 2` (rank 0 in the server's process, or in the engine process): a
    completion through HTTP equals the single-process one; killing rank 1 makes the server exit non-zero
    with the rank named, never hang."""
    import httpx
    from server_util import ServerProc

    from swiftlm import LLM

    body = {"model": "x", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    with LLM(str(tiny_llama), backend="torch") as single:
        want = single.generate("Once upon a time", _greedy(24)).text
    s = ServerProc(
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--tensor-parallel",
        "2",
        "--parallel",
        "2",
        "--engine-process",
        engine_process,
    )
    try:
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]
        if r.json()["choices"][0]["finish_reason"] == "length":
            assert got == want
        else:  # stopped at EOS: the single run's text starts with it
            assert want.startswith(got)
        (pid,) = _followers(s.proc.pid)
        os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        while s.proc.poll() is None and time.time() - t0 < 60:
            time.sleep(0.2)
        assert s.proc.poll() is not None, "the server kept running without rank 1"
        assert s.proc.returncode != 0
        assert "tensor-parallel rank 1" in s.stderr_tail(), s.stderr_tail()
    finally:
        s.stop()
