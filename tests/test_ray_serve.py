"""Ray Serve as the scale-out engine (swiftlm.deploy.ray_serve), on a local Ray cluster on this CPU.

One module-scoped cluster: two replicas of the bundled SmolLM2 (torch, CPU) behind Ray's HTTP proxy, and one plain
`swiftlm serve` with the same flags as the reference engine.  The tests run in file order (the crash test last).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import ray  # the ray extra, in the dev extras
from server_util import ServerProc, free_port

FLAGS = ("--backend", "torch", "--device", "cpu", "--parallel", "4", "--log-level", "warning")
LONG = "Answer as a careful assistant of a small bakery would: plain sentences, briefly, on topic. " * 3


def _chat(topic: str, max_tokens: int, stream: bool) -> dict:
    """A prompt whose first 256 characters (its affinity key) differ by topic."""
    return {
        "messages": [{"role": "user", "content": f"Tell me about {topic}. {LONG}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def _short(content: str, max_tokens: int, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


class Stream:
    """A streamed chat completion read on a thread: its replica (from the headers) and its events."""

    def __init__(self, base: str, body: dict):
        self.events: list[dict | str] = []
        self.headers: dict | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(base, body), daemon=True)
        self.thread.start()

    def _run(self, base: str, body: dict) -> None:
        try:
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
                self.headers = dict(r.headers)
                self.status = r.status_code
                self.started.set()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()
            self.first.set()

    def join(self, timeout: float = 120) -> Stream:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream hung"
        return self

    @property
    def replica(self) -> str:
        return self.headers["x-swiftlm-replica"]

    @property
    def text(self) -> str:
        return "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in self.events
            if isinstance(e, dict) and e.get("choices")
        )


@pytest.fixture(scope="module")
def cluster(bundled_gguf):
    from ray import serve

    from swiftlm.deploy.ray_serve import build_app

    t0 = time.monotonic()
    refs: list = []  # the reference server starts while Ray does
    starting = threading.Thread(target=lambda: refs.append(ServerProc("--model", str(bundled_gguf), *FLAGS)))
    starting.start()
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": str(bundled_gguf), "replicas": 2, "serve_args": " ".join(FLAGS), "health_check_period_s": 1}
        serve.run(build_app(args), name="swiftlm", route_prefix="/")
        starting.join()
        (ref,) = refs
        print(f"\nRay Serve with two replicas and the reference server up in {time.monotonic() - t0:.1f} s")
        yield f"http://127.0.0.1:{port}", ref.base, args
    finally:
        # ray.shutdown() alone: it stops the local cluster's processes, replicas included, and each replica's
        # `swiftlm serve` dies with it (PR_SET_PDEATHSIG).  serve.shutdown() first drained the replicas one by
        # one (~5 s), which no test looks at.
        ray.shutdown()
        starting.join()
        for ref in refs:
            assert ref.stop() == 0, ref.stderr_tail()


def _references(ref: str, bodies: list[dict]) -> list[str]:
    """The reference server's greedy texts for ``bodies`` (sent at once: it batches them)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(body: dict) -> str:
        r = httpx.post(ref + "/v1/chat/completions", json={**body, "stream": False}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def _streams_on_both(base: str, make, n_max: int = 12) -> list[Stream]:
    """Streams with distinct prompts until both replicas hold at least one."""
    streams: list[Stream] = []
    for i in range(n_max):
        s = Stream(base, make(i))
        s.started.wait(60)
        assert s.error is None and s.status == 200, s.error
        streams.append(s)
        if len({x.replica for x in streams}) == 2 and len(streams) >= 3:
            break
    assert len({x.replica for x in streams}) == 2, "every stream went to one replica"
    return streams


def test_two_replicas_stream_what_one_engine_says(cluster):
    base, ref, _ = cluster
    topics = ["bread", "cakes", "opening hours", "flour", "ovens", "croissants", "prices", "delivery", "rye", "tarts"]
    streams = _streams_on_both(base, lambda i: _chat(topics[i], 24, True))
    for s in streams:
        s.join()
        assert s.error is None
        assert s.events[-1] == "[DONE]"
        assert s.events[-2]["choices"][0]["finish_reason"] == "length"
    assert [s.text for s in streams] == _references(ref, [_chat(topics[i], 24, False) for i in range(len(streams))])


def test_prefix_affinity_keeps_a_conversation_on_one_replica(cluster):
    base, _, _ = cluster
    for topic in ("bread", "cakes", "rye"):
        replicas = set()
        for turn in range(3):  # one conversation's prefix (system prompt + first message), growing
            body = _chat(topic, 4, False)
            body["messages"] += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More."}] * turn
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            replicas.add(r.headers["x-swiftlm-replica"])
        assert len(replicas) == 1, topic


def test_routes_and_errors_pass_through_unchanged(cluster):
    base, ref, _ = cluster
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    via, direct = (
        httpx.post(b + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=120)
        for b in (base, ref)
    )
    assert via.status_code == direct.status_code == 200, via.text
    assert via.json()["content"] == direct.json()["content"] and via.json()["stop_reason"] == "max_tokens"
    # a client error is the replica server's own 4xx, in the route's shape
    bad = httpx.post(base + "/v1/chat/completions", json={"messages": [], "max_tokens": -1}, timeout=60)
    same = httpx.post(ref + "/v1/chat/completions", json={"messages": [], "max_tokens": -1}, timeout=60)
    assert bad.status_code == same.status_code and 400 <= bad.status_code < 500
    assert bad.json() == same.json()
    models = [httpx.get(b + "/v1/models", timeout=60).json()["data"] for b in (base, ref)]
    assert [m["id"] for m in models[0]] == [m["id"] for m in models[1]]


def test_a_replica_crash_ends_only_its_streams_and_ray_restarts_it(cluster):
    base, ref, _ = cluster
    n_tokens = 96
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    streams = _streams_on_both(base, lambda i: _short(f"Write a long story about {words[i]}.", n_tokens, True))
    for s in streams:
        assert s.first.wait(60) and s.events, "no first token"
    victim = streams[0].replica
    pid = int(streams[0].headers["x-swiftlm-replica-pid"])
    os.kill(pid, signal.SIGKILL)  # the replica's swiftlm serve: its engine dies mid-stream
    t_kill = time.monotonic()
    for s in streams:
        s.join()
        assert s.error is None, s.error
    killed = [s for s in streams if s.replica == victim]
    alive = [s for s in streams if s.replica != victim]
    for s in killed:  # ends with an error event: no [DONE], no finish_reason
        assert "[DONE]" not in s.events
        assert s.events[-1]["error"]["type"] == "server_error", s.events[-1]
        assert victim in s.events[-1]["error"]["message"]
        assert not any(e["choices"][0].get("finish_reason") for e in s.events[:-1] if e.get("choices"))
    for s in alive:  # the other replica's streams complete unchanged
        assert s.events[-1] == "[DONE]"
    idx = [streams.index(s) for s in alive]
    want = _references(ref, [_short(f"Write a long story about {words[i]}.", n_tokens, False) for i in idx])
    assert [s.text for s in alive] == want
    # new requests right after the crash are served (by the survivor, or after a retry by any live replica)
    served = set()
    for i in range(4):
        r = httpx.post(base + "/v1/chat/completions", json=_short(f"Name a color {i}.", 4, False), timeout=120)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-swiftlm-replica"])
    assert victim not in served
    # Ray starts a replacement; it is served from too
    survivors = {s.replica for s in alive}
    deadline = time.monotonic() + 120
    new = None
    while new is None and time.monotonic() < deadline:
        r = httpx.post(base + "/v1/chat/completions", json=_short("Name a fruit.", 4, False), timeout=120)
        assert r.status_code == 200, r.text
        if r.headers["x-swiftlm-replica"] not in survivors | {victim}:
            new = r.headers["x-swiftlm-replica"]
        time.sleep(0.3)
    assert new is not None, "no replacement replica served a request within 120 s"
    print(f"\nreplacement replica {new} served {time.monotonic() - t_kill:.1f} s after the kill")


def test_removing_a_replica_finishes_its_streams(cluster):
    """Redeploying with one replica while both stream: Ray stops a replica only after its streams end (a redeploy
    from code replaces the replicas too, one that serves from now on)."""
    from ray import serve

    from swiftlm.deploy.ray_serve import build_app

    base, ref, args = cluster
    words = ["oak", "pine", "birch", "elm", "ash", "fir", "yew", "lime", "beech", "maple", "cedar", "larch"]
    body = lambda i: _short(f"Describe a walk among {words[i]} trees.", 96, True)  # noqa: E731
    streams = _streams_on_both(base, body)
    for s in streams:
        assert s.first.wait(60) and s.events
    assert all(s.thread.is_alive() for s in streams)  # every stream is mid-way when the removal starts
    serve.run(build_app({**args, "replicas": 1}), name="swiftlm", route_prefix="/")  # returns once it is done
    for s in streams:
        s.join()
        assert s.error is None and s.events[-1] == "[DONE]", s.events[-1:]
    want = _references(ref, [{**body(i), "stream": False} for i in range(len(streams))])
    assert [s.text for s in streams] == want
    served = {
        httpx.post(base + "/v1/chat/completions", json=_short(f"Name a tree {i}.", 4, False), timeout=120).headers[
            "x-swiftlm-replica"
        ]
        for i in range(3)
    }
    assert len(served) == 1


# ---------------------------------------------------------------------- routing, without a cluster
def test_affinity_key_follows_the_prompt_prefix():
    from swiftlm.deploy.affinity import affinity_key

    first = _chat("bread", 4, False)
    later = _chat("bread", 4, False)
    later["messages"] += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More."}]
    assert affinity_key(first) is not None and affinity_key(first) == affinity_key(later)
    assert affinity_key(_chat("cakes", 4, False)) != affinity_key(first)
    assert affinity_key(_short("Hi", 4, False)) is None  # 256 characters or fewer: no key
    assert affinity_key(first, chars=0) is None
    # Anthropic's system prompt and a list of text parts count; completions' prompt too
    msgs = {"system": LONG, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    other = {"system": LONG, "messages": [{"role": "user", "content": "b"}]}
    assert affinity_key(msgs) == affinity_key(other)  # the first 256 characters are the shared system prompt
    assert affinity_key({"prompt": LONG}) == affinity_key({"prompt": [LONG + "x"]})
    assert affinity_key({"prompt": LONG}) != affinity_key({"prompt": "x" + LONG})
    assert affinity_key([1, 2]) is None and affinity_key({"messages": "nope"}) is None


def test_rendezvous_moves_only_the_removed_replicas_keys():
    from swiftlm.deploy.affinity import rank

    keys = [f"{i:016x}" for i in range(400)]
    three = {k: rank(k, ["a", "b", "c"])[0] for k in keys}
    two = {k: rank(k, ["a", "c"])[0] for k in keys}
    assert {k: h for k, h in three.items() if h != "b"} == {k: h for k, h in two.items() if three[k] != "b"}
    assert {two[k] for k in keys if three[k] == "b"} == {"a", "c"}  # b's keys spread over the others
    assert 100 < sum(h == "b" for h in three.values()) < 170  # about a third each


def test_router_sends_a_key_home_and_spills_past_the_slack():
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from swiftlm.deploy.affinity import rank
    from swiftlm.deploy.ray_serve import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the routing policy alone, without Ray's state
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.initialize_state(slack=4)
    dep = DeploymentID(name="SwiftLMReplica", app_name="swiftlm")
    reps = [SimpleNamespace(replica_id=ReplicaID(unique_id=u, deployment_id=dep)) for u in ("r1", "r2", "r3")]
    ids = lambda ranks: [[r.replica_id.unique_id for r in rank_] for rank_ in ranks]  # noqa: E731
    choose = lambda key: ids(asyncio.run(router.choose_replicas(reps, SimpleNamespace(kwargs={"affinity_key": key}))))  # noqa: E731
    home, *rest = rank("00ff", ["r1", "r2", "r3"])
    assert choose("00ff")[0] == [home]
    assert sorted(choose("00ff")[1]) == sorted(rest)
    cache = router._replica_queue_len_cache
    rid = {r.replica_id.unique_id: r.replica_id for r in reps}
    cache.update(rid[home], 5)
    cache.update(rid[rest[0]], 2)
    assert choose("00ff") == [[rest[1], rest[0]], [home]]  # 5 - 0 >= 4: the least loaded others first
    cache.update(rid[rest[1]], 3)
    assert choose("00ff") == [[home], [rest[0], rest[1]]]  # 5 - 2 < 4: home
    no_key = ids(asyncio.run(router.choose_replicas(reps, SimpleNamespace(kwargs={}))))
    assert len(no_key) == 1 and len(no_key[0]) == 2 and set(no_key[0]) <= {"r1", "r2", "r3"}


def test_only_the_ray_serve_module_imports_ray():
    """Ray stays an extra: no module of swiftlm but swiftlm/deploy/ray_serve.py imports it, and that one imports
    neither torch nor mlx (a Ray cluster's ingress node needs neither)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    importers: dict[str, set[str]] = {}
    for f in [*(root / "swiftlm").rglob("*.py"), *(root / "backends").rglob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                importers.setdefault(n.split(".")[0], set()).add(f.relative_to(root).as_posix())
    assert importers["ray"] == {"swiftlm/deploy/ray_serve.py"}
    deploy = {p for mods in ("torch", "mlx") for p in importers.get(mods, ()) if p.startswith("swiftlm/deploy/")}
    assert deploy == set()
