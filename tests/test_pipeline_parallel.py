"""--pipeline-parallel on the CPU: 2 stages (gloo on localhost) against the single-process model.

A stage boundary copies an fp32 activation tensor; no arithmetic changes, so a step without
micro-batches (one prompt chunk, or one decode row) gives bit-for-bit the single-process logits.
Micro-batched decode steps run their matmuls on fewer rows at a time (the engine's own batching
has the same effect), so greedy tokens are compared, as the tensor-parallel tests do."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import PY, ROOT, make_ckpt, needs_torch, run_cli

pytestmark = needs_torch

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fibonacci(n):"]


def _greedy(n: int = 32):
    from swiftlm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def untied5(tmp_path_factory) -> Path:
    """Five layers (stages of 2 and 3 layers) and an LM head of its own (on the last stage only)."""
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "untied5",
        "--arch",
        "llama",
        "--dtype",
        "float32",
        "--layers",
        "5",
        "--no-tie",
        "--seed",
        "5",
        "--shard-mb",
        "1",
    )


@pytest.fixture(scope="module", params=["tiny_llama", "untied5"])
def pair(request, tiny_llama, untied5):
    from swiftlm import LLM

    model = {"tiny_llama": str(tiny_llama), "untied5": str(untied5)}[request.param]
    single = LLM(model, backend="torch", parallel=4)
    old = os.environ.get("SWIFTLM_PP_MICRO_MIN_ROWS")
    os.environ["SWIFTLM_PP_MICRO_MIN_ROWS"] = "1"  # micro-batch even 2-row decode batches (rank 0's value rules)
    try:
        pp = LLM(model, backend="torch", parallel=4, pipeline_parallel=2)
    finally:
        if old is None:
            os.environ.pop("SWIFTLM_PP_MICRO_MIN_ROWS")
        else:
            os.environ["SWIFTLM_PP_MICRO_MIN_ROWS"] = old
    assert (pp.engine.model.micro, pp.engine.model.micro_min_rows) == (2, 1)
    yield request.param, single, pp
    pp.close()
    single.close()


def first_logits(llm, tokens: list[int]):
    """Rank 0's logits of a one-chunk prefill (the engine is idle meanwhile)."""
    from swiftlm.backend import SeqWork, StepBatch
    from swiftlm.sampling import SamplerState, SamplingParams

    model = llm.engine.model
    sid = 10**6 + len(tokens)
    fwd = model.forward(StepBatch([SeqWork(sid, tokens, 0, True, SamplingParams(), SamplerState())]))
    model.free([sid])
    return fwd.logits[0].float()


def test_greedy_tokens_equal_single_process(pair):
    name, single, pp = pair
    for p in PROMPTS:
        assert pp.generate(p, _greedy()).token_ids == single.generate(p, _greedy()).token_ids, (name, p)


def test_engine_process_rank0_greedy_equal(tiny_llama):
    """--engine-process on: stage 0 lives in the engine process, which spawns stage 1."""
    from swiftlm import LLM

    with LLM(str(tiny_llama), backend="torch", parallel=4) as single:
        want = [single.generate(p, _greedy()).token_ids for p in PROMPTS]
    with LLM(str(tiny_llama), backend="torch", parallel=4, pipeline_parallel=2, engine_process="on") as pp:
        assert set(pp.engine.rank_pids) == {1}
        assert [o.token_ids for o in pp.generate(PROMPTS, _greedy())] == want


def test_batched_concurrent_requests_equal(pair):
    """Four prompts at once: prompt chunks pipelined as units, decode rows as 2 micro-batches."""
    name, single, pp = pair
    want = [single.generate(p, _greedy()).token_ids for p in PROMPTS]
    before = pp.engine.model.pp_stats["micro_batched_steps"]
    got = [o.token_ids for o in pp.generate(PROMPTS, _greedy())]
    assert got == want, name
    assert pp.engine.model.pp_stats["micro_batched_steps"] - before >= 16  # decode steps ran as 2 micro-batches


def test_first_step_logits_equal_within_fp32_rounding(pair):
    """One prompt chunk: the same fp32 operations on the two stages as in one process (the boundary is a
    copy), so the logits are bit for bit equal when every process runs its matmuls on the same number of
    threads (OMP_NUM_THREADS=1 here); a BLAS that splits a reduction differently over another thread
    count re-associates sums, bounded by
    L * K * 2**-24 * max|logit| as in tests/test_tensor_parallel.py.  A wrong stage split moves logits by O(1)."""
    import torch

    name, single, pp = pair
    a = single.engine.model.module.a
    K = max(a.hidden, a.heads * a.head_dim, a.intermediate)
    for p in PROMPTS[:2]:
        toks = single.engine.text_prompt(p)
        want, got = first_logits(single, toks), first_logits(pp, toks)
        assert got.shape == want.shape
        if torch.get_num_threads() == 1 and os.environ.get("OMP_NUM_THREADS") == "1":
            assert torch.equal(got, want), (name, float((got - want).abs().max()))
        tol = a.layers * K * 2.0**-24 * float(want.abs().max())
        assert float((got - want).abs().max()) <= tol, (name, float((got - want).abs().max()), tol)
        assert int(got.argmax()) == int(want.argmax())


def test_prompt_cache_reuse_per_stage(pair):
    """A repeated prompt restores its KV rows from the prompt cache on every stage (each keeps its
    own layers' rows under rank 0's key) and continues exactly as a fresh prefill."""
    name, single, pp = pair
    prompt = list(range(5, 45))
    first = pp.generate(prompt, _greedy(16))
    second = pp.generate(prompt, _greedy(16))
    assert second.usage["cached_tokens"] > 0, name
    assert second.token_ids == first.token_ids == single.generate(prompt, _greedy(16)).token_ids, name
    assert pp.engine.model.failed is None


def test_stage_split_and_units():
    from swiftlm.backend import SeqWork, StepBatch
    from swiftlm.backends.torch.pipeline import rank_of, stage_layers, stage_of, units_of

    assert [stage_layers(5, s, 2) for s in range(2)] == [(0, 2), (2, 5)]
    assert [stage_layers(30, s, 4) for s in range(4)] == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert [stage_of(r, 3) for r in range(3)] == [2, 0, 1]  # rank 0 holds the last stage (head + sampler)
    assert [rank_of(s, 3) for s in range(3)] == [1, 2, 0]
    seqs = [SeqWork(i, [7], 10, True, None, None) for i in range(5)] + [SeqWork(9, [1, 2, 3], 0, True, None, None)]
    units, batched = units_of(StepBatch(seqs), 2)
    assert units == [[0, 1], [2, 3, 4], [5]] and batched  # decode rows in 2 micro-batches, the prompt alone
    assert units_of(StepBatch(seqs), 1)[0] == [[0, 1, 2, 3, 4], [5]]
    assert units_of(StepBatch(seqs), 2, min_rows=3)[0] == [[0, 1, 2, 3, 4], [5]]  # 2 parts would be < 3 rows
    assert units_of(StepBatch(seqs[:1]), 2) == ([[0]], False)


def test_each_stage_reads_only_its_tensors(untied5):
    """Stage 0: the embedding and layers 0-1; stage 1: layers 2-4 (renumbered 0-2), the final norm
    and the LM head -- nothing else is read from the safetensors files."""
    from swiftlm.backends.torch.loader import read_tensors
    from swiftlm.backends.torch.pipeline import make_stage
    from swiftlm.registry import resolve

    spec = resolve(str(untied5))
    st0, st1 = make_stage(spec, spec.config, 0, 2), make_stage(spec, spec.config, 1, 2)
    assert (st0.l0, st0.l1, st1.l0, st1.l1) == (0, 2, 2, 5)
    s0, s1 = read_tensors(spec, st0.pick), read_tensors(spec, st1.pick)
    layers = lambda st: sorted({int(k.split(".")[2]) for k in st if ".layers." in k})  # noqa: E731
    assert layers(s0) == [0, 1] and layers(s1) == [0, 1, 2]
    assert {k for k in s0 if ".layers." not in k} == {"model.embed_tokens.weight"}
    assert {k for k in s1 if ".layers." not in k} == {"model.norm.weight", "lm_head.weight"}


def test_refusals(tiny_llama):
    """One sentence and exit code 2, before any rank starts."""
    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--pipeline-parallel",
        "2",
        "--turbo-kv",
        "--max-tokens",
        "2",
        "-p",
        "hi",
        timeout=120,
    )
    assert r.returncode == 2 and "--turbo-kv cannot be combined with --pipeline-parallel" in r.stderr, r.stderr[-2000:]
    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--pipeline-parallel",
        "2",
        "--tensor-parallel",
        "2",
        "--max-tokens",
        "2",
        "-p",
        "hi",
        timeout=120,
    )
    assert r.returncode == 2 and "cannot be combined yet" in r.stderr, r.stderr[-2000:]
    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--pipeline-parallel",
        "3",
        "--max-tokens",
        "2",
        "-p",
        "hi",
        timeout=120,
    )  # 2 layers
    assert r.returncode == 2 and "more stages than the model's 2 layers" in r.stderr, r.stderr[-2000:]
    env = {"SWIFTLM_DIST_KEY": ""}
    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--pipeline-parallel",
        "2",
        "--nnodes",
        "2",
        "--max-tokens",
        "2",
        "-p",
        "hi",
        timeout=120,
        env=env,
    )
    assert r.returncode == 2 and "SWIFTLM_DIST_KEY" in r.stderr, r.stderr[-2000:]


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from swiftlm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], backend="torch", pipeline_parallel=2)
        llm.generate("warm up", SamplingParams(max_tokens=4, temperature=0))
        (pid,) = [p.pid for p in llm.engine.model._procs.values()]
        def kill():
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
        t0 = time.time()
        try:  # a long generation: rank 0 waits in a recv from stage 0 when rank 1 dies
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


def test_stage_killed_mid_generation_fails_cleanly(tiny_llama, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PY, str(script), str(tiny_llama)], capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout
    assert r.returncode == 1, r.stderr[-3000:]  # a process that lost a rank exits 1 (control.Leader._fail)
    assert "NO ERROR" not in out
    assert "ERROR1" in out and "pipeline-parallel rank 1" in out and "killed by signal 9" in out, out
    assert "ERROR2" in out and "pipeline-parallel rank 1" in out.split("ERROR2")[1], out
    assert float(out.split("SECONDS")[1]) < 60


@pytest.mark.parametrize("flag", ["--pipeline-parallel", "--tensor-parallel"])
def test_two_nodes_on_localhost_answer_through_http(tiny_llama, flag):
    """`--nnodes 2`: two `swiftlm serve` processes started by hand (node 1 first, as a user on a
    second host would), meeting at --master-addr/--master-port with a shared SWIFTLM_DIST_KEY.
    Node 0 serves HTTP and its completion equals the single-process one; node 1 never listens and
    exits when node 0 stops.  The launch is shared, so --tensor-parallel spans hosts the same way."""
    import httpx
    from server_util import ServerProc, free_port

    from swiftlm import LLM

    body = {"model": "x", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    with LLM(str(tiny_llama), backend="torch") as single:
        want = single.generate("Once upon a time", _greedy(24)).text
    mport = free_port()
    common = [
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        flag,
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(mport),
    ]
    key = "pp-test-" + os.urandom(8).hex()
    env = dict(os.environ, SWIFTLM_DIST_KEY=key, HF_HUB_OFFLINE="1")
    port1 = free_port()
    node1 = subprocess.Popen(
        [PY, "-m", "swiftlm.cli", "serve", "--port", str(port1), *common, "--node-rank", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    s = None
    old = os.environ.get("SWIFTLM_DIST_KEY")
    os.environ["SWIFTLM_DIST_KEY"] = key  # ServerProc copies this process's environment
    try:
        try:
            s = ServerProc(*common, "--node-rank", "0")
        except RuntimeError as exc:  # show node 1's side too
            node1.kill()
            raise AssertionError(f"{exc}\n--- node 1 ---\n{node1.communicate(timeout=10)[1][-3000:]}") from None
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            assert choice["text"] == want
        else:  # stopped at EOS: the single run's text starts with it
            assert want.startswith(choice["text"])
        assert node1.poll() is None
        with pytest.raises(httpx.ConnectError):  # node 1 serves no HTTP
            httpx.get(f"http://127.0.0.1:{port1}/health", timeout=5)
        s.stop()
        out, err = node1.communicate(timeout=60)  # node 1 ends once rank 0 has stopped
        assert node1.returncode == 0, err[-3000:]
    finally:
        if old is None:
            os.environ.pop("SWIFTLM_DIST_KEY", None)
        else:
            os.environ["SWIFTLM_DIST_KEY"] = old
        if s is not None:
            s.stop()
        if node1.poll() is None:
            node1.send_signal(signal.SIGTERM)
            node1.wait(10)


def test_stage_args_slice_the_layer_windows():
    """A stage's layers are renumbered from 0, so its per-layer sliding windows must be the model's
    windows of [l0, l1) (the stage used the model's first layers' windows before)."""
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.backends.torch.pipeline import Stage

    def stage_args(a, l0, l1):
        return Stage(l0, l1, l0 == 0, False, False).args(a)

    base = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 512,
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 2,
    }
    a = Args.from_config(base)
    assert a.windows == (0, 0, 16, 16)
    assert stage_args(a, 0, 2).windows == (0, 0) and stage_args(a, 2, 4).windows == (16, 16)
    assert stage_args(a, 1, 3).layers == 2 and stage_args(a, 1, 3).window(1) == 16
    plain = Args.from_config({**base, "use_sliding_window": False})
    assert stage_args(plain, 2, 4).windows == ()
