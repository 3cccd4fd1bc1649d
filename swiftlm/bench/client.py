"""The HTTP side of ``swiftlm bench serve``: the requests (``Workload``, ``ClientConfig``), one streamed request
timed (``_one``), a run at a concurrency or a Poisson rate (``run_requests``) and its share spread over worker
processes (``run_workers``).  How each number is measured: ``serve.py``'s docstring."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import SwiftLMError
from .metrics import RequestRecord, chunk_content, merge_parts, parse_sse_line, poisson_arrivals, split_share


@dataclass
class Workload:
    """One request's body parts: ``payload`` is {"messages": [...]}, {"prompt": "..."} or {"prompt": [token ids]}."""

    index: int
    payload: dict[str, Any]
    max_tokens: int


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "chat"
    api_key: str | None = None
    temperature: float = 0.6
    ignore_eos_field: bool = False
    eos_bias_ids: list[int] = field(default_factory=list)
    concurrency: int | None = None
    request_rate: float | None = None
    timeout: float = 600.0
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self, w: Workload) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": self.model,
            **w.payload,
            "max_tokens": w.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos_field:
            b["ignore_eos"] = True
        if self.eos_bias_ids:
            b["logit_bias"] = {str(i): -100.0 for i in self.eos_bias_ids}  # a float: transformers serve rejects ints
        b.update(self.extra_body)
        return b


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# =========================================================================== the client
async def _one(client: Any, cfg: ClientConfig, w: Workload, t0: float) -> RequestRecord:
    rec = RequestRecord(index=w.index, max_tokens=w.max_tokens)
    chunks = rec.chunk_times
    body = cfg.body(w)
    done_at: float | None = None
    send = time.perf_counter()
    rec.send = send - t0
    try:
        async with client.stream("POST", cfg.path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                buf = b""
                async for data in resp.aiter_bytes():
                    now = time.perf_counter() - send
                    buf += data
                    if b"\n" not in data or done_at is not None:
                        continue  # after [DONE] the rest is read (keeps the connection reusable), not parsed
                    lines = buf.split(b"\n")
                    buf = lines.pop()
                    for line in lines:
                        kind, obj = parse_sse_line(line.rstrip(b"\r"))
                        if kind == "data":
                            if not _take(rec, obj, now):
                                break
                        elif kind == "done":
                            done_at = now
                            break
                    if rec.error:
                        break
                if buf and not rec.error and done_at is None:
                    kind, obj = parse_sse_line(buf.rstrip(b"\r"))
                    if kind == "data":
                        _take(rec, obj, time.perf_counter() - send)
    except Exception as exc:  # connect / read errors, bad JSON: this request fails, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__
    rec.e2e = time.perf_counter() - send if done_at is None else done_at
    if rec.error is None and not chunks:
        rec.error = "the stream carried no content"
    rec.ok = rec.error is None
    if chunks:
        rec.ttft = chunks[0]
    if not rec.usage_reported:
        rec.output_tokens = len(chunks)
    return rec


def _take(rec: RequestRecord, obj: Any, now: float) -> bool:
    """Account one parsed chunk; False when it is an error."""
    if not isinstance(obj, dict):
        return True
    if obj.get("error") or obj.get("object") == "error":
        err = obj.get("error") or obj
        rec.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))[:300]
        return False
    if chunk_content(obj):
        rec.chunk_times.append(now)
    u = obj.get("usage")
    if u and u.get("completion_tokens") is not None:
        rec.usage_reported = True
        rec.output_tokens = int(u["completion_tokens"])
        if u.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(u["prompt_tokens"])
    return True


def _client(cfg: ClientConfig, pool: int) -> Any:
    try:
        import httpx
    except ImportError:
        raise SwiftLMError("swiftlm bench serve needs httpx: pip install httpx") from None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    return httpx.AsyncClient(
        base_url=cfg.base_url,
        headers=headers,
        limits=limits,
        http2=False,
        timeout=httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0)),
    )


async def run_requests(
    cfg: ClientConfig,
    work: Sequence[Workload],
    on_done: Callable[[RequestRecord], None] | None = None,
    gate: Callable[[], None] | None = None,
) -> tuple[float, list[RequestRecord]]:
    """Send ``work`` (concurrency or Poisson rate from ``cfg``); returns (wall-clock start, records).  ``gate``:
    called (blocking) once the client is ready, just before the first request: the start line of --workers."""
    conc = cfg.concurrency
    pool = conc if conc else max(1, len(work))
    records: list[RequestRecord] = []

    def done(r: RequestRecord) -> None:
        records.append(r)
        if on_done is not None:
            on_done(r)

    async with _client(cfg, pool) as client:
        try:  # httpx/anyio import their network backend on the first request (~150 ms): not in anyone's TTFT
            await client.get("/v1/models", timeout=30)
        except Exception:
            pass  # an unreachable server fails each request below, with the reason
        if gate is not None:
            gate()
        start_wall, t0 = time.time(), time.perf_counter()
        if not cfg.request_rate:
            it = iter(work)

            async def worker() -> None:
                for w in it:  # each worker takes the next request when its previous one is done
                    done(await _one(client, cfg, w, t0))

            await asyncio.gather(*(worker() for _ in range(min(conc or 1, len(work)))))
        else:
            sem = asyncio.Semaphore(conc) if conc else None
            arrivals = poisson_arrivals(random.Random(cfg.seed), cfg.request_rate, len(work))

            async def send(w: Workload) -> None:
                if sem is None:
                    done(await _one(client, cfg, w, t0))
                    return
                async with sem:
                    done(await _one(client, cfg, w, t0))

            tasks = []
            for w, at in zip(work, arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(w)))
            await asyncio.gather(*tasks)
    return start_wall, records


async def discover_model(base_url: str, api_key: str | None, timeout: float = 30.0) -> str:
    """The first model id of GET /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as c:
            r = await c.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            if data:
                return str(data[0]["id"])
    except Exception as exc:
        raise SwiftLMError(
            f"could not list the models of {base_url} ({type(exc).__name__}: {exc}); pass --model"
        ) from None
    raise SwiftLMError(f"{base_url}/v1/models lists no model; pass --model")


# =========================================================================== worker processes
def _worker_main(cfg_dict: dict[str, Any], work: list[dict[str, Any]], q: Any, go: Any, delay: float = 0.0) -> None:
    """A child process of --workers: get ready (imports, client, first connection), say so, wait for ``go``
    (every worker ready), run its share, report each finished request, then all records.  ``delay``: a slower
    start-up, for the tests."""
    time.sleep(delay)
    cfg = ClientConfig(**cfg_dict)
    ws = [Workload(**w) for w in work]

    def gate() -> None:
        q.put(("ready", None))
        go.wait()

    try:
        start, recs = asyncio.run(run_requests(cfg, ws, on_done=lambda r: q.put(("done", r.ok)), gate=gate))
        q.put(("result", (start, [r.to_json() for r in recs])))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("fail", f"{type(exc).__name__}: {exc}"))


def run_workers(
    cfg: ClientConfig,
    work: Sequence[Workload],
    workers: int,
    on_done: Callable[[bool], None] | None = None,
    start_delays: Sequence[float] = (),
) -> list[RequestRecord]:
    """Run ``work`` in ``workers`` processes (requests dealt round-robin; concurrency or rate split) and merge.
    The processes start together: each gets ready (a spawned process takes a few hundred ms to import and
    connect, differently each time), then all send their first requests at once, so that N concurrent streams
    are N from the start (measured on an H100 before this: the 64th request of a 64-stream run went out 0.09-0.38 s
    after the first, and the aggregate swung ~10% between runs of one server).  ``start_delays``: per process, a
    slower start-up (tests)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    go = ctx.Event()
    shares = split_share(cfg.concurrency, workers) if cfg.concurrency else [None] * workers
    procs = []
    for k in range(workers):
        part = [asdict(w) for w in work[k::workers]]
        if not part:
            continue
        d = asdict(cfg)
        d["concurrency"] = shares[k]
        d["request_rate"] = cfg.request_rate / workers if cfg.request_rate else None
        d["seed"] = cfg.seed + k
        delay = start_delays[k] if k < len(start_delays) else 0.0
        p = ctx.Process(target=_worker_main, args=(d, part, q, go, delay), daemon=True)
        p.start()
        procs.append(p)
    parts: list[tuple[float, list[RequestRecord]]] = []
    ready = 0
    try:
        while len(parts) < len(procs):
            try:
                kind, val = q.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SwiftLMError(f"a benchmark worker process exited with code {dead[0]}") from None
                continue
            if kind == "ready":
                ready += 1
                if ready == len(procs):
                    go.set()
            elif kind == "done":
                if on_done is not None:
                    on_done(val)
            elif kind == "result":
                parts.append((val[0], [RequestRecord.from_json(r) for r in val[1]]))
            else:
                raise SwiftLMError(f"a benchmark worker process failed: {val}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return merge_parts(parts)
