"""--data-parallel: N engines behind one interface (swiftlm/distributed/replicas.py).

Routing is checked on stand-in engines (exact, no model); the real path on 2 replicas of the tiny
llama on the CPU: greedy outputs equal one engine's, requests spread, a shared prefix stays on one
replica and hits its prompt cache, and a server with --data-parallel 2 answers."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
from types import SimpleNamespace

import pytest
from conftest import ROOT, needs_torch, run_cli

from swiftlm.config import Settings
from swiftlm.distributed.replicas import AFFINITY_TOKENS, ReplicaSet, check_settings
from swiftlm.engine import QueueFull
from swiftlm.errors import ConfigError


# ---------------------------------------------------------------------- routing, on stand-in engines
class FakeEngine:
    def __init__(self, max_running: int = 2):
        self.scheduler = SimpleNamespace(max_running=max_running, waiting=[], running=[])
        self.stats = SimpleNamespace(requests_total=0)
        self.busy = 0  # requests it holds (what live_requests reports)
        self.fatal = None
        self.full = False
        self.slots = SimpleNamespace(ids=itertools.count(1))
        self.got: list[int] = []
        self.cancelled: list[int] = []
        self.on_fatal = None

    @property
    def live_requests(self) -> int:
        return self.busy

    def submit(self, prompt, params, sink):
        if self.full:
            raise QueueFull("full")
        sid = next(self.slots.ids)
        self.got.append(sid)
        return sid

    def cancel(self, sid):
        self.cancelled.append(sid)


def _long(tag: int, n: int = AFFINITY_TOKENS + 10) -> list[int]:
    return [tag] * AFFINITY_TOKENS + list(range(n - AFFINITY_TOKENS))


def test_least_loaded_routing_and_disjoint_ids():
    a, b = FakeEngine(), FakeEngine()
    rs = ReplicaSet([a, b])
    ids = [rs.submit([1, 2, 3], None, None) for _ in range(4)]  # short prompts: no affinity key
    assert rs.routed == [2, 2]  # each submit counts as outstanding until the engine takes it in
    assert a.got == [1, 3] and b.got == [2, 4]  # replica i numbers i+1, i+1+N, ...
    assert [rs.replica_of(s) for s in ids] == [0, 1, 0, 1]
    rs.cancel(ids[1])
    rs.cancel(ids[2])
    assert a.cancelled == [3] and b.cancelled == [2]


class FakeClient(FakeEngine):
    """An API worker's view of one replica (engine_process.EngineClient): its own pending requests, exact, and the
    other workers' live sequences at the replica's last stats snapshot."""

    def __init__(self, worker: int, others: int = 0):
        super().__init__(max_running=64)
        self.conn_index, self._others = worker, others
        self.slots.pending = 0

    def submit(self, prompt, params, sink):
        self.slots.pending += 1
        return super().submit(prompt, params, sink)


def test_api_workers_split_their_own_requests_evenly_whatever_the_others_counts_say():
    """Two workers, each routing a burst of 128 over two replicas while the other workers' counts they see are
    stale: each worker's own split is even (so the total is), the stale counts only break ties, and equal views
    send the two workers' first requests to different replicas."""
    split = []
    for worker, stale in ((0, (40, 0)), (1, (0, 25))):
        a, b = FakeClient(worker, stale[0]), FakeClient(worker, stale[1])
        rs = ReplicaSet([a, b])
        for _ in range(128):
            rs.submit([1, 2, 3], None, None)
        split.append(rs.routed)
    assert split == [[64, 64], [64, 64]]
    firsts = []
    for worker in (0, 1):
        a, b = FakeClient(worker), FakeClient(worker)
        rs = ReplicaSet([a, b])
        firsts.append(rs.replica_of(rs.submit([1], None, None)))
    assert firsts == [0, 1]  # equal loads: each worker starts on its own replica
    a, b = FakeClient(0, others=3), FakeClient(0, others=1)
    rs = ReplicaSet([a, b])
    assert rs.replica_of(rs.submit([1], None, None)) == 1  # own loads equal: the others' counts decide


def test_prefix_affinity_then_spill_when_much_busier():
    a, b = FakeEngine(max_running=2), FakeEngine(max_running=2)
    rs = ReplicaSet([a, b])
    assert rs.slack == 2  # one batch (--parallel) by default
    b.busy = 5
    assert rs.replica_of(rs.submit(_long(7), None, None)) == 0  # a new key goes to the least loaded
    b.busy = 0
    # replica 0 now has 1 outstanding, replica 1 none: less than `slack` busier -> stays home
    assert rs.replica_of(rs.submit(_long(7, 90), None, None)) == 0
    assert rs.affinity_hits == 1
    # replica 0 has 2 outstanding, replica 1 none: `slack` busier -> the least loaded takes it
    assert rs.replica_of(rs.submit(_long(7, 80), None, None)) == 1
    assert rs.affinity_spills == 1
    # the key keeps its home: once replica 0 drains it is chosen again although replica 1 is lighter
    a.stats.requests_total = 2  # the engine took both in ...
    a.busy = 0  # ... and finished them
    b.busy = 0
    b.stats.requests_total = 1
    a.busy = 1
    assert rs.replica_of(rs.submit(_long(7, 75), None, None)) == 0
    # another prefix gets its own home (the least loaded now: replica 1)
    assert rs.replica_of(rs.submit(_long(9), None, None)) == 1


def test_a_full_replica_is_skipped_and_all_full_is_429():
    a, b = FakeEngine(), FakeEngine()
    rs = ReplicaSet([a, b])
    a.full = True
    assert rs.replica_of(rs.submit([1, 2], None, None)) == 1
    assert rs.replica_of(rs.submit([1, 2], None, None)) == 1
    b.full = True
    with pytest.raises(QueueFull):
        rs.submit([1, 2], None, None)
    assert rs.routed == [0, 2]


def test_a_dead_replica_makes_the_set_fatal():
    a, b = FakeEngine(), FakeEngine()
    rs = ReplicaSet([a, b])
    told = []
    rs.on_fatal = told.append
    b.on_fatal("engine loop died: RuntimeError: boom")  # what Engine._run calls when its loop dies
    assert rs.fatal == "engine loop died: RuntimeError: boom" and told == [rs.fatal]
    with pytest.raises(QueueFull, match="boom"):
        rs.submit([1, 2], None, None)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"gpu_layers": 4}, "--gpu-layers"),
        ({"device": "cuda:1"}, "each replica takes its own device"),
        ({"extra_models": ["x"]}, "serves one model"),
    ],
)
def test_refused_combinations(kw, msg):
    torch_be = SimpleNamespace(name="torch", available=lambda: SimpleNamespace(device="cpu (2 threads)"))
    with pytest.raises(ConfigError, match=msg):
        check_settings(Settings(data_parallel=2, **kw), torch_be)
    mlx_be = SimpleNamespace(name="mlx", available=lambda: SimpleNamespace(device="metal"))
    with pytest.raises(ConfigError, match="needs the torch backend"):
        check_settings(Settings(data_parallel=2), mlx_be)
    cuda = SimpleNamespace(name="torch", available=lambda: SimpleNamespace(device="cuda (NVIDIA H100)"))
    assert check_settings(Settings(data_parallel=3), cuda) == ["cuda:0", "cuda:1", "cuda:2"]
    assert check_settings(Settings(data_parallel=2, device="cpu"), cuda) == ["cpu", "cpu"]


def test_cli_refuses_with_one_sentence_and_exit_2(tiny_llama):
    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--data-parallel",
        "2",
        "--gpu-layers",
        "1",
        "-p",
        "hi",
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "--data-parallel and --gpu-layers do not combine" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--model", str(tiny_llama), "--data-parallel", "0", "-p", "hi", timeout=120)
    assert r.returncode == 2 and "data_parallel" in r.stderr.replace("-", "_")


# ---------------------------------------------------------------------- 2 real replicas on the CPU
@pytest.fixture(scope="module")
def dp(tiny_llama):
    pytest.importorskip("torch")
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="torch", parallel=2, data_parallel=2, device="cpu")  # any machine
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def single(tiny_llama):
    pytest.importorskip("torch")
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="torch", parallel=4, device="cpu")
    yield llm
    llm.close()


PROMPTS = [
    "hello world this is",
    "the quick brown fox jumps over",
    "a b c d e f g",
    "one two three four",
    "SwiftLM serves",
    "data parallel replicas",
]


@needs_torch
def test_greedy_outputs_equal_one_engine_and_requests_spread(dp, single):
    from swiftlm import SamplingParams

    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in single.generate(PROMPTS, p)]
    before = list(dp.engine.routed)
    out = [o.token_ids for o in dp.generate(PROMPTS, p)]  # submitted together: concurrent
    assert out == ref
    got = [n - b for n, b in zip(dp.engine.routed, before)]
    assert sum(got) == len(PROMPTS) and min(got) >= 2, got  # both replicas served
    # each replica's own engine counted what the set routed to it
    assert [e.stats.requests_total for e in dp.engine.replicas] == dp.engine.routed
    st = dp.engine.stats  # aggregated: the sum of the replicas' counters
    assert st.tokens_generated == sum(e.stats.tokens_generated for e in dp.engine.replicas)
    assert st.duration.count == st.requests_total == sum(dp.engine.routed)


@needs_torch
def test_replicas_in_engine_processes(tiny_llama, single):
    """--engine-process on (the default on CUDA): each replica is a child process behind its client."""
    from swiftlm import LLM, SamplingParams

    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in single.generate(PROMPTS[:4], p)]
    with LLM(str(tiny_llama), backend="torch", parallel=2, data_parallel=2, device="cpu", engine_process="on") as llm:
        assert [type(e).__name__ for e in llm.engine.replicas] == ["EngineClient"] * 2
        assert [o.token_ids for o in llm.generate(PROMPTS[:4], p)] == ref
        assert llm.engine.routed == [2, 2]


@needs_torch
def test_shared_prefix_lands_on_one_replica_and_hits_its_prompt_cache(dp):
    from swiftlm import SamplingParams

    rs = dp.engine
    system = [(7 * i) % 4000 + 100 for i in range(AFFINITY_TOKENS + 16)]  # a long shared "system prompt"
    routed0 = list(rs.routed)
    hits0 = [e.prefix_cache.hits for e in rs.replicas]
    for k in range(4):  # one after another: each finds the previous one's cache entry
        dp.generate(system + [200 + k, 300 + k, 400 + k], SamplingParams(max_tokens=4, temperature=0))
    routed = [n - b for n, b in zip(rs.routed, routed0)]
    home = routed.index(4)  # all four on one replica
    hits = [e.prefix_cache.hits - h for e, h in zip(rs.replicas, hits0)]
    assert hits[home] == 3 and sum(hits) == 3, hits
    assert rs.prefix_cache.hits == sum(e.prefix_cache.hits for e in rs.replicas)  # the aggregate view


@needs_torch
def test_server_with_data_parallel_answers(tiny_llama):
    import httpx
    from server_util import ServerProc

    s = ServerProc(
        "--model", str(tiny_llama), "--backend", "torch", "--data-parallel", "2", "--parallel", "2", "--device", "cpu"
    )
    try:

        def one(i: int) -> dict:
            r = httpx.post(
                s.base + "/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 6, "temperature": 0}, timeout=120
            )
            assert r.status_code == 200, r.text
            return r.json()

        with cf.ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(one, range(4)))
        assert all(o["usage"]["completion_tokens"] > 0 for o in outs)
        h = httpx.get(s.base + "/health", timeout=30).json()
        dpst = h["stats"]["data_parallel"]
        assert h["status"] == "ok" and dpst["replicas"] == 2
        assert sum(r["routed"] for r in dpst["per_replica"]) == 4 == h["stats"]["requests_total"]
        assert h["stats"]["tokens_generated"] == sum(r["tokens_generated"] for r in dpst["per_replica"])
        m = httpx.get(s.base + "/metrics", timeout=30).text
        assert "swiftlm_engine_requests_total 4\n" in m  # counts print as integers
    finally:
        assert s.stop() == 0, s.stderr_tail()


# ---------------------------------------------------------------------- the multi-host examples
def _serve_flags_ok(args: list[str]) -> Settings:
    """The flags parse with `swiftlm serve`'s own parser into valid settings."""
    from swiftlm.cli import _parser
    from swiftlm.config import settings_from_args

    return settings_from_args(_parser().parse_args(["serve", *args]))


def test_kubernetes_example_is_valid():
    import kubernetes_validate
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "docs" / "deploy" / "kubernetes.yaml").read_text()))
    for d in docs:  # against the Kubernetes API's schema (bundled in the package: no network), unknown fields refused
        kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)
    typo = yaml.safe_load(yaml.safe_dump(docs[0]).replace("readinessProbe", "readinesProbe"))
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(typo, kubernetes_validate.latest_version(), strict=True)
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    dep = kinds["Deployment"]
    assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    assert kinds["Service"]["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["swiftlm", "serve"]
    s = _serve_flags_ok(c["args"])
    assert s.data_parallel == c["resources"]["limits"]["nvidia.com/gpu"] == 2
    port = c["ports"][0]["containerPort"]
    assert s.port == port and s.host == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > s.shutdown_timeout


def test_ray_serve_example_builds_and_its_flags_parse():
    """docs/deploy/ray_serve.py builds the Ray Serve application (no cluster needed for that), its arguments are
    RayServeArgs fields, and the flags it gives every replica are ones `swiftlm serve` accepts."""
    import importlib.util

    from ray.serve import Application

    from swiftlm.deploy.ray_serve import RayServeArgs

    spec = importlib.util.spec_from_file_location("ray_serve_example", ROOT / "docs" / "deploy" / "ray_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert isinstance(mod.app, Application)
    a = RayServeArgs(**mod.ARGS)
    assert a.num_gpus == 1 and a.replicas == 2
    s = _serve_flags_ok(["--model", a.model, *a.serve_args.split()])
    assert s.offline and s.parallel == 64
