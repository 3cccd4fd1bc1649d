"""SwiftLM under Ray Serve: one ``swiftlm serve`` per Ray Serve replica, an ingress that routes by prompt prefix.

    pip install "swiftlm[torch,ray]"
    serve run swiftlm.deploy.ray_serve:build_app model=/models/Llama-3.1-8B-Instruct replicas=4 num_gpus=1

Two deployments make the application:

- ``SwiftLMReplica`` (``replicas`` of them, each with ``num_gpus`` / ``num_cpus`` of Ray's resources): starts
  ``swiftlm serve`` on a loopback port in a child process and relays requests to it, streams included.  The
  child dies with the replica (PR_SET_PDEATHSIG); when the child dies, its open streams end with an error event
  in the route's shape and the replica's actor exits, so Ray drops it from routing at once and starts a new one.
- ``SwiftLMIngress`` (Ray's HTTP proxy sends it every request): reads the body, computes the prompt's affinity
  key (``swiftlm.deploy.affinity``) and calls a replica through a handle whose request router
  (``PrefixAffinityRouter``) sends a key to its home replica, or to the least loaded other one when the home has
  ``affinity_slack`` more requests in flight than that one, or ``max_ongoing_requests``.  Requests without a key go to the less loaded of two random replicas.
  A request whose replica fails before answering (it died, or its server is gone) is retried on another; a
  stream whose replica dies mid-way ends with an error event.  Status, body and content type are the replica's
  server's own, so the OpenAI, Anthropic, Responses and Ollama routes are unchanged; each response also says
  which replica served it (``x-swiftlm-replica``) and the pid of its ``swiftlm serve`` process
  (``x-swiftlm-replica-pid``).

Replicas are added and removed with ``replicas`` (redeploy with another number) or with Ray's autoscaling
(``min_replicas`` / ``max_replicas``): a replica being removed takes no new requests and finishes its streams
first (up to ``drain_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from pydantic import BaseModel, Field
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .affinity import AFFINITY_CHARS, affinity_key, rank

log = logging.getLogger("swiftlm.deploy.ray_serve")

# request headers that describe the client's connection, not the request: not relayed to a replica
_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te"})
# response headers that Ray's HTTP proxy writes itself
_OWN = _HOP | {"date", "server", "content-encoding"}
_RETRIES = 3  # a request whose replica fails before answering goes to another replica this many times


class RayServeArgs(BaseModel):
    """``serve run swiftlm.deploy.ray_serve:build_app KEY=VALUE ...`` (or ``build_app({...})`` in Python)."""

    model: str | None = Field(None, description="--model of every replica (default: the bundled model)")
    serve_args: str = Field("", description="more `swiftlm serve` flags for every replica, one string")
    replicas: int = Field(2, ge=1, description="replicas (without min_replicas/max_replicas)")
    min_replicas: int | None = Field(None, ge=0, description="autoscaling: fewest replicas")
    max_replicas: int | None = Field(None, ge=1, description="autoscaling: most replicas")
    target_ongoing_requests: float = Field(32, gt=0, description="autoscaling: requests in flight per replica")
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (Ray sets CUDA_VISIBLE_DEVICES)")
    num_cpus: float = Field(1, ge=0, description="CPUs per replica (Ray's logical resource)")
    max_ongoing_requests: int = Field(64, ge=1, description="requests one replica holds before others get them")
    affinity_chars: int = Field(AFFINITY_CHARS, ge=0, description="prefix length of the affinity key (0: off)")
    affinity_slack: int = Field(
        16, ge=1, description="a prompt leaves its home replica when that has this many more requests in flight"
    )
    ready_timeout_s: float = Field(1800, gt=0, description="how long a replica may take to load its model")
    drain_timeout_s: float = Field(600, gt=0, description="how long a removed replica may finish its streams")
    health_check_period_s: float = Field(2, gt=0, description="how often Ray checks a replica")


# ---------------------------------------------------------------------------------------------- the replica
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec: SIGKILL when the replica's process dies
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stream_error(path: str, content_type: str, message: str) -> bytes:
    """The last event of a stream that broke, in the route's own shape (b"" where the body is not a stream)."""
    if "text/event-stream" in content_type:
        if path.rstrip("/").endswith("/messages"):  # Anthropic
            from ..server.anthropic import error_body as anthropic_error

            return f"event: error\ndata: {json.dumps(anthropic_error(500, message))}\n\n".encode()
        from ..server.errors import error_body

        return f"data: {json.dumps(error_body(500, message))}\n\n".encode()
    if "ndjson" in content_type:  # Ollama
        return (json.dumps({"error": message}) + "\n").encode()
    return b""


def _error(path: str, status: int, message: str) -> JSONResponse:
    if path.rstrip("/").endswith("/messages"):
        from ..server.anthropic import error_body as anthropic_error

        return JSONResponse(anthropic_error(status, message), status_code=status)
    from ..server.errors import error_body

    return JSONResponse(error_body(status, message), status_code=status)


class SwiftLMReplica:
    """One ``swiftlm serve`` in a child process; ``forward`` relays one request to it."""

    def __init__(self, model: str | None, serve_args: list[str], ready_timeout_s: float = 1800) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "swiftlm.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += (["--model", model] if model else []) + list(serve_args)
        self.proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
        self.pid = self.proc.pid
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Ray Serve (a unit test)
            self.replica = f"local-{os.getpid()}"
        self._stopping = False
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + ready_timeout_s
        while True:  # /health answers 503 while the model loads
            if self.proc.poll() is not None:
                raise RuntimeError(f"swiftlm serve exited with code {self.proc.returncode} while loading")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"swiftlm serve was not ready after {ready_timeout_s:.0f} s")
            time.sleep(0.25)
        self.client = httpx.AsyncClient(base_url=base, timeout=None)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        """The server died: let the open streams send their error events, then end this actor (Ray replaces it)."""
        code = self.proc.wait()
        if self._stopping:
            return
        log.error(
            "replica %s: swiftlm serve (pid %d) exited with code %s; the replica exits", self.replica, self.pid, code
        )
        time.sleep(1.0)
        os._exit(1)

    async def forward(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes, affinity_key: str | None
    ):
        """Yields a dict (status, headers, replica, pid) and then the response body's chunks.  ``affinity_key`` is
        read by the router only."""
        meta = {"replica": self.replica, "pid": self.pid}
        try:
            req = self.client.build_request(method, path, params=query or None, headers=headers, content=body)
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:  # the server is gone (this actor is about to exit): the ingress retries
            yield {**meta, "unavailable": f"{type(e).__name__}: {e}"}
            return
        ctype = resp.headers.get("content-type", "")
        keep = {k: v for k, v in resp.headers.items() if k.lower() not in _OWN}
        yield {**meta, "status": resp.status_code, "headers": keep}
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            msg = f"replica {self.replica} failed mid-response: {type(e).__name__}: {e}"
            log.error(msg)
            yield stream_error(path, ctype, msg)
        finally:
            await resp.aclose()

    def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"swiftlm serve exited with code {self.proc.returncode}")

    def __del__(self) -> None:  # Ray stops the replica (scale-down, redeploy, shutdown): stop the server cleanly
        self._stopping = True
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()  # swiftlm serve finishes its streams (--shutdown-timeout), then exits
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---------------------------------------------------------------------------------------------- routing
class PrefixAffinityRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """A request with an affinity key goes to its home replica (rendezvous hashing over the replica ids) unless
    that one has ``slack`` or more requests in flight beyond the least loaded other one (Ray's cached queue
    lengths), or is full (``max_ongoing_requests``): then to the least loaded other.  A request without a key goes
    to the less loaded of two random replicas."""

    def initialize_state(self, slack: int = 16, **kwargs: Any) -> None:
        self.slack = max(1, int(slack))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = (pending_request.kwargs or {}).get("affinity_key") if pending_request is not None else None
        if key is None or len(candidate_replicas) == 1:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        home, *others = [by_id[i] for i in rank(key, by_id)]
        cache = self.replica_queue_len_cache

        def load(r: RunningReplica) -> int:
            return cache.get(r.replica_id) or 0

        others.sort(key=load)
        if load(home) - load(others[0]) >= getattr(self, "slack", 16):
            return [others, [home]]
        return [[home], others]


# ---------------------------------------------------------------------------------------------- the ingress
class SwiftLMIngress:
    """Ray's HTTP proxy sends every request here; it picks the affinity key and relays to a replica."""

    def __init__(self, replicas: Any, affinity_chars: int = AFFINITY_CHARS) -> None:
        self.replicas = replicas
        self.affinity_chars = affinity_chars

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        key = None
        if body and request.method == "POST":
            try:
                key = affinity_key(json.loads(body), self.affinity_chars)
            except (ValueError, UnicodeDecodeError):
                pass  # the replica's server answers a malformed body with its own 400
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        args = (request.method, path, request.url.query, headers, body)
        handle = self.replicas.options(stream=True)
        last = "no replica answered"
        for attempt in range(_RETRIES + 1):
            gen = handle.forward.remote(*args, affinity_key=key)
            try:
                meta = await gen.__anext__()
            except (RayActorError, ActorUnavailableError) as e:  # it died before answering: nothing was generated
                last = f"{type(e).__name__}: {e}"
            except StopAsyncIteration:
                last = "the replica ended the request without an answer"
            else:
                if "unavailable" not in meta:
                    break
                last = meta["unavailable"]
            log.warning("request %s %s: replica failed before answering (%s); retrying", request.method, path, last)
            await asyncio.sleep(0.2 * (attempt + 1))
        else:
            return _error(path, 503, f"no replica could serve the request: {last}")

        resp_headers = dict(meta["headers"])
        resp_headers["x-swiftlm-replica"] = str(meta["replica"])
        resp_headers["x-swiftlm-replica-pid"] = str(meta["pid"])
        ctype = resp_headers.get("content-type", "")

        async def body_chunks():
            try:
                async for chunk in gen:
                    yield chunk
            except RayError as e:  # the replica's process died mid-response
                msg = f"replica {meta['replica']} died mid-response: {type(e).__name__}"
                log.error("%s: %s", msg, e)
                tail = stream_error(path, ctype, msg)
                if tail:
                    yield tail

        return StreamingResponse(body_chunks(), status_code=meta["status"], headers=resp_headers)


# ---------------------------------------------------------------------------------------------- the app
def build_app(args: RayServeArgs | dict[str, Any] | None = None) -> Any:
    """The Ray Serve application; ``serve run swiftlm.deploy.ray_serve:build_app model=... replicas=N``."""
    a = args if isinstance(args, RayServeArgs) else RayServeArgs(**(args or {}))
    scale: dict[str, Any] = {"num_replicas": a.replicas}
    if a.min_replicas is not None or a.max_replicas is not None:
        lo = a.min_replicas if a.min_replicas is not None else 1
        hi = a.max_replicas if a.max_replicas is not None else max(lo, a.replicas)
        scale = {
            "num_replicas": "auto",
            "autoscaling_config": AutoscalingConfig(
                min_replicas=lo,
                max_replicas=max(lo, hi),
                initial_replicas=min(max(lo, a.replicas), max(lo, hi)),
                target_ongoing_requests=a.target_ongoing_requests,
            ),
        }
    replica = serve.deployment(
        SwiftLMReplica,
        name="SwiftLMReplica",
        ray_actor_options={"num_cpus": a.num_cpus, "num_gpus": a.num_gpus},
        max_ongoing_requests=a.max_ongoing_requests,
        health_check_period_s=a.health_check_period_s,
        health_check_timeout_s=max(30.0, a.health_check_period_s * 5),
        graceful_shutdown_timeout_s=a.drain_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"slack": a.affinity_slack}
        ),
        **scale,
    )
    ingress = serve.deployment(
        SwiftLMIngress,
        name="SwiftLMIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
        graceful_shutdown_timeout_s=a.drain_timeout_s,
    )
    return ingress.bind(replica.bind(a.model, shlex.split(a.serve_args), a.ready_timeout_s), a.affinity_chars)
