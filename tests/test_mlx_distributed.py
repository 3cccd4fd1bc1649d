"""--distributed (MLX): 2 ranks started by ``mlx.launch --backend ring`` on localhost against the
single-process MLX model.

mlx-lm's tensor sharding computes the same function: Q/K/V and gate/up projections split by output
rows (each rank computes its rows exactly as the whole matmul would, up to the CPU kernel's
blocking), O and down projections split by input columns and summed across ranks by the ring's
all-sum.  Only the summation order of those reductions differs, so greedy tokens must be equal and
first-step logits equal within the fp32 rounding bound of tests/tolerances.py.

Cost: every all-sum of MLX's ring backend is a round trip between two processes (4 per token for
the 2-layer test model), and each rank imports mlx-lm (transformers) on the same few cores, so one
launch takes a while; the server test is marked slow."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import threading
import time
import types
import urllib.request
from pathlib import Path

import pytest
from conftest import PY, ROOT, make_ckpt, needs_mlx, run_cli
from tolerances import transformer_logits_tol

pytestmark = needs_mlx

LAUNCH = str(Path(PY).parent / "mlx.launch")
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fibonacci(n):"]
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# Run by every rank (the ranks > 0 never return from LLM(): they follow rank 0 and exit when it closes), and by
# the test process itself for the single-process side (``run``; a subprocess of its own spent ~4 s of its ~5 s
# starting Python and importing mlx-lm).
SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from swiftlm import LLM, SamplingParams
    from swiftlm.backend import SeqWork, StepBatch
    from swiftlm.sampling import SamplerState

    def run(model, out, dist, prompts, sharding):
        llm = LLM(model, backend="mlx", parallel=4, distributed=dist, distributed_sharding=sharding)
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        one = [llm.generate(p, greedy).token_ids for p in prompts]
        together = [o.token_ids for o in llm.generate(prompts, greedy)]  # prefill + batched decode rows
        m = llm.engine.model
        logits = []
        for i, p in enumerate(prompts):  # the first step's full-vocabulary logits (the engine is idle)
            sid = 10**6 + i
            fwd = m.forward(StepBatch([SeqWork(sid, llm.engine.text_prompt(p), 0, True, SamplingParams(),
                                               SamplerState())]))
            logits.append(np.array(fwd.logits[0]).tolist())
            m.free([sid])
        llm.close()
        with open(out, "w") as f:
            json.dump({"one": one, "together": together, "logits": logits}, f)

    if __name__ == "__main__":
        run(sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4]), sys.argv[5])
""")


def _env() -> dict:
    return dict(os.environ, **ENV)


def ring_port() -> int:
    """A port p with p and p+1 free (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def launch(*cmd: str, n: int = 2) -> list[str]:
    """mlx.launch reads its own options anywhere on the line (``--backend mlx`` included): ``--``
    ends them."""
    return [LAUNCH, "-n", str(n), "--backend", "ring", "-p", str(ring_port()), "--python", PY, "--", *cmd]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Untied embeddings: a random model whose greedy tokens vary from step to step (a tied tiny
    random model mostly repeats the prompt's last token, which would make token equality weak)."""
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "qwen3", "--arch", "qwen3", "--dtype", "float32", "--no-tie", "--seed", "5"
    )


@pytest.fixture(scope="module")
def untied_llama(tmp_path_factory) -> Path:
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "llama", "--arch", "llama", "--dtype", "float32", "--no-tie", "--seed", "7"
    )


def _run_script(tmp_path: Path, model: Path, distributed: bool, sharding: str = "auto") -> dict:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    out = tmp_path / ("two.json" if distributed else "one.json")
    if not distributed:  # the same code in this process: the model, the engine and the kernels are the same
        ns: dict = {"__name__": "ranks"}
        exec(compile(SCRIPT, str(script), "exec"), ns)
        ns["run"](str(model), str(out), False, PROMPTS, sharding)
        return json.loads(out.read_text())
    args = [str(script), str(model), str(out), "1", json.dumps(PROMPTS), sharding]
    r = subprocess.run(launch(*args), capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    # mlx.launch exits 0 whatever its ranks do; it warns for each rank that failed or was killed
    assert "Node with rank" not in r.stderr, r.stderr[-4000:]
    return json.loads(out.read_text())


def test_two_ranks_equal_single_process(tmp_path, tiny_qwen3):
    import numpy as np

    single = _run_script(tmp_path, tiny_qwen3, distributed=False)
    two = _run_script(tmp_path, tiny_qwen3, distributed=True)  # both ranks end cleanly when rank 0 closes
    assert len({t for seq in single["one"] for t in seq}) > 12, "the test model's greedy tokens should vary"
    assert two["one"] == single["one"]
    assert two["together"] == single["together"] == single["one"]
    cfg = types.SimpleNamespace(**json.loads((tiny_qwen3 / "config.json").read_text()))
    for p, a, b in zip(PROMPTS, single["logits"], two["logits"]):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape == (cfg.vocab_size,)  # rank 0 holds the full vocabulary
        m = float(np.abs(a).max())
        tol = transformer_logits_tol(cfg, m, context=16)
        diff = float(np.abs(a - b).max())
        assert diff <= tol, (p, diff, tol)
        # the bound is far below what a bug moves (e.g. another prompt's logits): it cannot hide one
        assert tol < 1e-2 * m


@pytest.mark.slow
def test_pipeline_two_ranks_equal_single_process_exactly(tmp_path):
    """mlx-lm's pipeline sharding (qwen3_moe: layers 0-1 on rank 1, 2-3 on rank 0, the last hidden
    state all-gathered): every layer runs whole on one rank, so the logits are bit-identical.
    Several sequences in one step need each sequence's send/recv pairs in the same order on both
    ranks (MLXModel.eval_each): without it the batched run's tokens differed for 2 of 4 prompts."""
    import numpy as np

    moe = make_ckpt(
        tmp_path / "moe", "--arch", "qwen3_moe", "--dtype", "float32", "--no-tie", "--seed", "3", "--layers", "4"
    )
    single = _run_script(tmp_path, moe, distributed=False)
    two = _run_script(tmp_path, moe, distributed=True, sharding="pipeline")
    assert two["one"] == single["one"]
    assert two["together"] == single["together"] == single["one"]
    for a, b in zip(single["logits"], two["logits"]):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_sharding_choice_and_refusals(tmp_path, tiny_qwen3):
    """What can be split over how many ranks, decided before any process starts."""
    from swiftlm.backends.mlx.distributed import choose_sharding, sharding_support
    from swiftlm.errors import ConfigError
    from swiftlm.registry import resolve

    support = sharding_support()
    assert support["llama"] == (True, False) and support["qwen3"] == (True, False)
    assert support["qwen2"] == (True, True) and "gemma" not in support
    spec = resolve(str(tiny_qwen3))  # 4 query heads, 2 KV heads, 2 layers
    assert choose_sharding(spec, "auto", 2) == "tensor"
    with pytest.raises(ConfigError, match="divisible by 4"):
        choose_sharding(spec, "auto", 4)  # 2 KV heads cannot be split 4 ways
    with pytest.raises(ConfigError, match="no pipeline sharding for 'qwen3'"):
        choose_sharding(spec, "pipeline", 2)
    gemma = resolve(str(make_ckpt(tmp_path / "gemma", "--arch", "gemma", "--dtype", "float32")))
    with pytest.raises(ConfigError, match="no tensor or pipeline sharding for architecture 'gemma'"):
        choose_sharding(gemma, "auto")


def test_cli_refuses_without_launcher_and_unsplittable_models(tmp_path, tiny_qwen3):
    r = run_cli(
        "generate",
        "--model",
        str(tiny_qwen3),
        "--backend",
        "mlx",
        "--distributed",
        "-p",
        "hi",
        "--max-tokens",
        "2",
        timeout=120,
        env=ENV,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the distributed group has size 1" in r.stderr and "mlx.launch" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli(
        "serve",
        "--model",
        str(tiny_qwen3),
        "--backend",
        "mlx",
        "--distributed",
        "--data-parallel",
        "2",
        "--port",
        "0",
        timeout=120,
        env=ENV,
    )
    assert r.returncode == 2 and "--data-parallel cannot be combined with --distributed" in r.stderr, r.stderr[-2000:]
    r = run_cli(
        "serve", "--model", str(tiny_qwen3), "--backend", "mlx", "--distributed-sharding", "rows", timeout=120, env=ENV
    )
    assert r.returncode == 2 and "must be auto, tensor or pipeline" in r.stderr, r.stderr[-2000:]


class _Launched:
    """``mlx.launch`` running ``swiftlm serve --distributed`` on 2 ranks; output drained on threads."""

    def __init__(self, model: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = launch(
            "-m",
            "swiftlm.cli",
            "serve",
            "--distributed",
            "--model",
            str(model),
            "--backend",
            "mlx",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--parallel",
            "2",
        )
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(), start_new_session=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.ready = threading.Event()

        def pump(stream, into):
            for line in stream:
                into.append(line)
                if '"ready"' in line:
                    self.ready.set()

        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=pump, args=(stream, into), daemon=True).start()

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the rank processes (children of mlx.launch, MLX_RANK in their environment)."""
        out = {}
        kids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in kids:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for kv in env:
                if kv.startswith(b"MLX_RANK="):
                    out[int(kv.split(b"=")[1])] = int(pid)
        return out

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.mark.slow
def test_server_answers_and_a_dead_rank_stops_it(untied_llama):
    from swiftlm import LLM, SamplingParams

    messages = [{"role": "user", "content": "Name three colors."}]
    single = LLM(str(untied_llama), backend="mlx")
    want = single.chat(messages, SamplingParams(max_tokens=8, temperature=0)).text
    single.close()

    srv = _Launched(untied_llama)
    try:
        assert srv.ready.wait(180), "".join(srv.err)[-4000:]
        ranks = srv.rank_pids()
        assert sorted(ranks) == [0, 1], ranks
        body = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["message"]["content"] == want
        # only rank 0 listens for HTTP (both ranks were given the same --port)
        assert srv.out.count(next(x for x in srv.out if '"ready"' in x)) == 1

        os.kill(ranks[1], signal.SIGKILL)  # a rank dies: rank 0 must stop, with the reason, not hang
        t0 = time.monotonic()
        srv.proc.wait(60)
        took = time.monotonic() - t0
        err = "".join(srv.err)
        assert "rank 1 closed its connection; the model needs all 2 ranks" in err, err[-4000:]
        assert "Node with rank 0 exited with code 1" in err, err[-4000:]  # rank 0 ended itself, non-zero
        assert took < 30, took
    finally:
        srv.stop()
