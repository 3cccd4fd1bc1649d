#!/usr/bin/env python3
"""Soak test: many concurrent streams against one server for a long time, watching its memory.

N client tasks loop until the duration ends.  Each sends, at random:
  - a well-formed streaming chat or text completion (mixed prompt lengths, shared and unique
    prefixes, mixed max_tokens), read to ``[DONE]``;  a share of them disconnects mid-stream
    (after a random number of chunks, or while still waiting for the first one);
  - a share of non-streamed completions;
  - a share of bad requests (malformed JSON, wrong types, out-of-range fields, unknown roles),
    which must be answered with a 4xx.
Every few seconds it samples the server's resident memory (from /proc/<pid> when this script
started the server, else from /health's memory.process_rss_bytes) and /health's stats.

Writes JSON (settings, time series, summary) and a PNG plot, and exits 1 if a well-formed request
failed (an error status, an error frame, a stream without [DONE]), any 5xx appeared,
requests_active did not return to 0 after the load stopped, or RSS after the warm-up grew more
than --max-rss-growth (default 5%) over its level at the end of the warm-up.

    scripts/soak.py --streams 200 --duration 1800 --warmup 300            # starts the bundled model
    scripts/soak.py --url http://127.0.0.1:5413 --streams 32 --duration 120 --warmup 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part river mountain engine memory stream token garden window history music"
).split()
SYSTEMS = [
    "You are a helpful assistant.",
    "Answer briefly and precisely.",
    "You are a poet who writes about the sea. " * 8,
    "You are a careful engineer. Explain your reasoning step by step and keep answers short. " * 6,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Server:
    """``python -m swiftlm.cli serve`` on a free loopback port; waits for its ready line."""

    def __init__(self, args: list[str], timeout: float = 300, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swiftlm.cli", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
        )
        ready = threading.Event()
        self.ready: dict | None = None

        def out() -> None:
            for line in self.proc.stdout:
                if line.startswith("{") and '"ready"' in line:
                    self.ready = json.loads(line)
                    ready.set()
            ready.set()

        def err() -> None:
            for line in self.proc.stderr:
                self.stderr.append(line)
                del self.stderr[:-400]

        threading.Thread(target=out, daemon=True).start()
        threading.Thread(target=err, daemon=True).start()
        deadline = time.time() + timeout
        while not ready.wait(0.2) and time.time() < deadline and self.proc.poll() is None:
            pass
        if self.ready is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr[-40:]))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# ------------------------------------------------------------------------------------------ requests
def _prompt(rng: random.Random) -> str:
    n = int(rng.choice([4, 8, 16, 32, 64, 128, 256]) * rng.uniform(0.5, 1.0))
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def good_request(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    mt = min(max_tokens, int(rng.choice([1, 4, 16, 32, 64, 128, 256, 512])))
    temp = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.75:
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.7 else []
        msgs.append({"role": "user", "content": _prompt(rng)})
        if rng.random() < 0.2:  # a multi-turn chat
            msgs += [{"role": "assistant", "content": _prompt(rng)}, {"role": "user", "content": _prompt(rng)}]
        return "/v1/chat/completions", {
            "messages": msgs,
            "max_tokens": mt,
            "temperature": temp,
            "seed": rng.randrange(1 << 31),
        }
    return "/v1/completions", {
        "prompt": _prompt(rng),
        "max_tokens": mt,
        "temperature": temp,
        "seed": rng.randrange(1 << 31),
    }


MSG = [{"role": "user", "content": "hi"}]
BAD: list[tuple[str, Any]] = [
    ("/v1/chat/completions", b'{"messages": ['),  # malformed JSON
    ("/v1/chat/completions", b"[1, 2, 3]"),  # not an object
    ("/v1/chat/completions", b'{"messages": "\xff\xfe"}'),  # bad UTF-8
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "ten"}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10_000_000}),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 5}),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 2}),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"abc": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"model": "x"}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": "yes"}),
]


class Tally:
    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.status: Counter[int] = Counter()
        self.failures: list[dict] = []
        self.tokens = 0  # content chunks received
        self.drain_seconds = 0.0  # from the end of the load to requests_active == 0 (or the timeout)

    def fail(self, kind: str, **info: Any) -> None:
        self.c["failed"] += 1
        if len(self.failures) < 50:
            self.failures.append({"kind": kind, **info})


async def stream_one(
    client: httpx.AsyncClient,
    rng: random.Random,
    t: Tally,
    path: str,
    body: dict,
    disconnect_prob: float,
    ending: asyncio.Event,
) -> None:
    body = {**body, "stream": True}
    cut_after = rng.choice([0, 1, 2, 4, 8, 16, 32]) if rng.random() < disconnect_prob else None
    give_up = rng.uniform(0.5, 20.0) if cut_after == 0 else None  # while waiting for its first token
    chunks, done, finished, error = 0, False, False, None

    async def read() -> None:
        nonlocal chunks, done, finished, error
        async with client.stream("POST", path, json=body) as r:
            t.status[r.status_code] += 1
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                error = f"status {r.status_code}: {text}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    return
                obj = json.loads(data)
                if "error" in obj:
                    error = f"error frame: {obj['error']}"
                    continue
                for ch in obj.get("choices") or []:
                    if ch.get("finish_reason"):
                        finished = True
                    if (ch.get("delta") or {}).get("content") or ch.get("text"):
                        chunks += 1
                        t.tokens += 1
                if cut_after and chunks >= cut_after:
                    return  # leaving the block closes the connection: a client disconnect

    task = asyncio.create_task(read())
    end = asyncio.create_task(ending.wait())
    try:
        await asyncio.wait({task, end}, timeout=give_up, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        end.cancel()
    if not task.done():  # the client gives up waiting, or the load ends: it disconnects
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        t.c["cancelled_at_end" if ending.is_set() else "cancelled"] += 1
        return
    exc = task.exception()
    if isinstance(exc, (httpx.HTTPError, json.JSONDecodeError)):
        t.fail("transport", path=path, error=f"{type(exc).__name__}: {exc}")
        return
    if exc is not None:
        raise exc
    if error is not None:
        if error.startswith("status 5") or error.startswith("error frame"):
            t.c["5xx"] += 1
        t.fail("stream", path=path, error=error, max_tokens=body.get("max_tokens"))
    elif done and finished:
        t.c["ok"] += 1
    elif cut_after is not None and not done:
        t.c["cancelled"] += 1
    else:
        t.fail("incomplete stream", path=path, done=done, finished=finished, chunks=chunks)


async def plain_one(client: httpx.AsyncClient, t: Tally, path: str, body: dict) -> None:
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        t.fail("transport", path=path, error=f"{type(exc).__name__}: {exc}")
        return
    t.status[r.status_code] += 1
    if r.status_code == 200 and r.json().get("choices"):
        t.c["ok"] += 1
        return
    if r.status_code >= 500:
        t.c["5xx"] += 1
    t.fail("status", path=path, status=r.status_code, body=r.text[:300])


async def bad_one(client: httpx.AsyncClient, rng: random.Random, t: Tally) -> None:
    path, body = rng.choice(BAD)
    try:
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        t.fail("transport (bad request)", path=path, error=f"{type(exc).__name__}: {exc}")
        return
    t.status[r.status_code] += 1
    if 400 <= r.status_code < 500:
        t.c["bad_rejected"] += 1
    elif r.status_code >= 500:
        t.c["5xx"] += 1
        t.c["bad_5xx"] += 1
        if len(t.failures) < 50:
            t.failures.append(
                {
                    "kind": "bad request -> 5xx",
                    "path": path,
                    "body": repr(body)[:200],
                    "status": r.status_code,
                    "answer": r.text[:300],
                }
            )
    else:
        t.c["bad_accepted"] += 1  # the server took it (e.g. a value it can clamp): not a failure


async def worker(i: int, client: httpx.AsyncClient, a: argparse.Namespace, ending: asyncio.Event, t: Tally) -> None:
    """Requests back to back until the load ends.  Then a stream in flight disconnects, and a
    non-streamed request is waited for (as its client would)."""
    rng = random.Random(a.seed * 100_003 + i)
    while not ending.is_set():
        x = rng.random()
        if x < a.bad_share:
            await bad_one(client, rng, t)
        else:
            path, body = good_request(rng, a.max_tokens)
            if x < a.bad_share + a.plain_share:
                body["max_tokens"] = min(body["max_tokens"], a.plain_max_tokens)
                await plain_one(client, t, path, body)
            else:
                await stream_one(client, rng, t, path, body, a.disconnect_share, ending)
        t.c["sent"] += 1


async def sampler(
    url: str, pid: int | None, every: float, t0: float, stop: asyncio.Event, t: Tally, series: list[dict], tag: dict
) -> None:
    """Samples every ``every`` seconds, tagged with the current round and phase."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as hc:
        while True:
            series.append({**await sample(hc, pid, t0, t), **tag})
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except asyncio.TimeoutError:
                pass


async def sample(hc: httpx.AsyncClient, pid: int | None, t0: float, t: Tally) -> dict:
    row: dict[str, Any] = {"t": round(time.monotonic() - t0, 2)}
    try:
        h = (await hc.get("/health")).json()
    except (httpx.HTTPError, ValueError):
        h = {}
    mem, st = h.get("memory") or {}, h.get("stats") or {}
    row["rss"] = rss_of(pid) if pid else int(mem.get("process_rss_bytes") or mem.get("active") or 0)
    row["peak_rss"] = int(mem.get("process_peak_rss_bytes") or 0)
    row["allocator_free"] = int(mem.get("allocator_free_bytes") or 0)
    row["allocator_in_use"] = int(mem.get("allocator_in_use_bytes") or 0)  # malloc'd and live (C/C++/Rust heap)
    row["python_blocks"] = int(mem.get("python_allocated_blocks") or 0)  # live pymalloc blocks
    row["prompt_cache_bytes"] = int(mem.get("prompt_cache_bytes") or (st.get("prompt_cache") or {}).get("bytes") or 0)
    row["kv_bytes"] = int(mem.get("kv_bytes") or st.get("kv_bytes_in_use") or 0)
    row["kv_allocated"] = int(mem.get("kv_allocated_bytes") or row["kv_bytes"])
    for k in ("requests_active", "queue_depth", "running", "tokens_generated", "requests_total"):
        row[k] = st.get(k)
    row.update({k: t.c[k] for k in ("ok", "cancelled", "failed", "5xx", "bad_rejected")})
    return row


def summarize(series: list[dict], t: Tally, a: argparse.Namespace, active_after: int | None, elapsed: float) -> dict:
    """One round: the RSS peak after the warm-up against the RSS peak during the warm-up (peak
    against peak: under a steady load RSS swings with the KV of whichever sequences are running, so a
    peak compared with one instant of the warm-up measures that swing, not growth; that comparison is
    still reported, as ``rss_growth_vs_warmup_end``).  ``rss_windows`` gives the
    peak and median of every window of ``warmup`` seconds, to show a trend.  Several rounds (load,
    then every client gone and requests_active back to 0): the warm-up is the first round; each
    later round's RSS peak against the first round's, and the idle RSS after each round against the
    idle RSS after the first."""
    load = [r for r in series if r.get("phase") == "load" and r["rss"]]
    if a.rounds > 1:
        warm = [r for r in load if r["round"] == 0]
        after = [r for r in load if r["round"] > 0]
    else:
        warm = [r for r in load if r["t"] <= a.warmup]
        after = [r for r in load if r["t"] > a.warmup]
    idle = [r for r in series if r.get("phase") == "idle"]
    s: dict[str, Any] = {
        "elapsed_s": round(elapsed, 1),
        "rounds": a.rounds,
        "requests_sent": t.c["sent"],
        "ok": t.c["ok"],
        "cancelled": t.c["cancelled"],
        "cancelled_at_end": t.c["cancelled_at_end"],
        "abandoned_at_end": t.c["abandoned_at_end"],
        "drain_s": t.drain_seconds,
        "failed": t.c["failed"],
        "5xx": t.c["5xx"],
        "bad_rejected_4xx": t.c["bad_rejected"],
        "bad_accepted": t.c["bad_accepted"],
        "bad_5xx": t.c["bad_5xx"],
        "content_chunks": t.tokens,
        "status_counts": {str(k): v for k, v in sorted(t.status.items())},
        "requests_active_after": active_after,
        "rss_start_bytes": load[0]["rss"] if load else None,
        "rss_max_bytes": max((r["rss"] for r in load), default=None),
        "rss_final_bytes": series[-1]["rss"] if series else None,
        "rss_idle_after_each_round_bytes": [r["rss"] for r in idle],
        "rss_peak_each_round_bytes": [
            max((r["rss"] for r in load if r["round"] == k), default=0) for k in range(a.rounds)
        ],
    }

    def rest(r: dict) -> int:  # RSS less what live sequences' KV and the prompt cache hold (diagnostic)
        return r["rss"] - r.get("kv_allocated", 0) - r.get("prompt_cache_bytes", 0)

    if warm and after:
        if a.rounds > 1:
            base, base_rest = max(r["rss"] for r in warm), max(rest(r) for r in warm)
        else:
            base, base_rest = max(r["rss"] for r in warm), max(rest(r) for r in warm)
            end = sum(r["rss"] for r in warm[-3:]) / len(warm[-3:])
            s["rss_growth_vs_warmup_end"] = round(max(r["rss"] for r in after) / end - 1, 4)
            width = max(a.warmup, 1.0)
            s["rss_windows"] = [
                {"from_s": round(k * width), "peak_bytes": max(w), "median_bytes": sorted(w)[len(w) // 2]}
                for k in range(int(max(r["t"] for r in load) // width) + 1)
                if (w := [r["rss"] for r in load if k * width <= r["t"] < (k + 1) * width])
            ]
        peak = max(r["rss"] for r in after)
        s.update(
            {
                "rss_warmup_bytes": int(base),
                "rss_max_after_warmup_bytes": peak,
                "rss_last_under_load_bytes": after[-1]["rss"],
                "rss_growth_after_warmup": round(peak / base - 1, 4),
                "rss_less_kv_and_prompt_cache_growth_after_warmup": round(
                    max(rest(r) for r in after) / base_rest - 1, 4
                ),
            }
        )
        for key in ("allocator_in_use", "python_blocks"):  # where growth lives: C/C++/Rust heap or Python objects
            w = [r.get(key, 0) for r in warm[-3:]]
            if all(w):
                s[f"{key}_warmup"] = int(sum(w) / len(w))
                s[f"{key}_max_after_warmup"] = max(r.get(key, 0) for r in after)
                s[f"{key}_growth_after_warmup"] = round(s[f"{key}_max_after_warmup"] / s[f"{key}_warmup"] - 1, 4)
    if len(idle) > 1:
        s["rss_idle_growth"] = round(max(r["rss"] for r in idle[1:]) / idle[0]["rss"] - 1, 4)
    checks = {
        "no_failed_well_formed": t.c["failed"] == 0 and t.c["abandoned_at_end"] == 0,
        "no_5xx": t.c["5xx"] == 0,
        "requests_active_back_to_0": active_after == 0,
    }
    if "rss_growth_after_warmup" in s:
        checks["rss_growth_within_limit"] = s["rss_growth_after_warmup"] <= a.max_rss_growth
    if "rss_idle_growth" in s:
        checks["rss_idle_growth_within_limit"] = s["rss_idle_growth"] <= a.max_rss_growth
    s["checks"] = checks
    s["passed"] = all(checks.values())
    s["failures"] = t.failures
    return s


def plot(series: list[dict], summary: dict, a: argparse.Namespace, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [r["t"] / 60 for r in series]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(ts, [r["rss"] / 2**20 for r in series], label="process RSS", color="tab:blue", lw=2)
    if any(r.get("prompt_cache_bytes") for r in series):
        ax.plot(
            ts, [r["prompt_cache_bytes"] / 2**20 for r in series], label="prompt cache (counted)", color="tab:green"
        )
    if any(r.get("kv_allocated") for r in series):
        ax.plot(
            ts,
            [r.get("kv_allocated", 0) / 2**20 for r in series],
            label="KV allocated (running and queued sequences)",
            color="tab:purple",
            lw=1,
        )
    if any(r.get("allocator_in_use") for r in series):
        ax.plot(
            ts, [r.get("allocator_in_use", 0) / 2**20 for r in series], label="malloc in use", color="tab:brown", lw=1
        )
    if any(r.get("allocator_free") for r in series):
        ax.plot(ts, [r["allocator_free"] / 2**20 for r in series], label="malloc free (held)", color="tab:gray", lw=1)
    if "rss_warmup_bytes" in summary:
        lim = summary["rss_warmup_bytes"] * (1 + a.max_rss_growth) / 2**20
        what = "first round's peak" if a.rounds > 1 else "warm-up peak"
        ax.axhline(lim, color="tab:red", ls=":", lw=1, label=f"{what} +{a.max_rss_growth:.0%}")
    idle = [r for r in series if r.get("phase") == "idle"]
    if idle:
        ax.plot(
            [r["t"] / 60 for r in idle],
            [r["rss"] / 2**20 for r in idle],
            "o",
            color="tab:blue",
            ms=6,
            label="RSS idle after a round",
        )
    warm_end = idle[0]["t"] if a.rounds > 1 and idle else a.warmup
    ax.axvline(warm_end / 60, color="k", ls="--", lw=1, label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(
        ts,
        [r.get("requests_active") or 0 for r in series],
        color="tab:orange",
        lw=0.8,
        alpha=0.7,
        label="requests_active",
    )
    ax2.set_ylabel("requests active")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(a: argparse.Namespace, url: str, pid: int | None) -> tuple[list[dict], Tally, int | None, float]:
    t = Tally()
    series: list[dict] = []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=a.streams + 8, max_keepalive_connections=a.streams + 8)
    stop = asyncio.Event()
    tag = {"round": 0, "phase": "load"}
    samp = asyncio.create_task(sampler(url, pid, a.sample_every, t0, stop, t, series, tag))
    active, load_s = None, 0.0
    # no read timeout: a client waits for its turn in the queue however long it takes
    timeout = httpx.Timeout(None, connect=30, pool=None)
    async with (
        httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client,
        httpx.AsyncClient(base_url=url, timeout=30) as hc,
    ):
        for k in range(a.rounds):
            tag.update(round=k, phase="load")
            ending = asyncio.Event()
            t_start = time.monotonic()
            workers = [asyncio.create_task(worker(i, client, a, ending, t)) for i in range(a.streams)]
            await asyncio.sleep(a.duration / a.rounds)
            ending.set()  # the load ends: open streams disconnect, non-streamed requests are waited for
            tag["phase"] = "drain"
            t_end = time.monotonic()
            load_s += t_end - t_start
            _, late = await asyncio.wait(workers, timeout=a.drain_timeout)
            for w in late:  # still waiting after the drain timeout: given up
                w.cancel()
                t.c["abandoned_at_end"] += 1
            await asyncio.gather(*workers, return_exceptions=True)
            for w in workers:
                if not w.cancelled() and w.exception() is not None:
                    t.fail("client error", error=repr(w.exception()))
            # requests_active must drain to 0 (the disconnects above cancel)
            while True:
                row = await sample(hc, pid, t0, t)
                active = row.get("requests_active")
                if active == 0 or time.monotonic() > t_end + a.drain_timeout:
                    break
                await asyncio.sleep(1.0)
            t.drain_seconds = max(t.drain_seconds, round(time.monotonic() - t_end, 1))
            await asyncio.sleep(2.0)
            series.append({**await sample(hc, pid, t0, t), "round": k, "phase": "idle"})
    stop.set()
    await samp
    return series, t, active, load_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server (its RSS is read from /health); default: start one")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model for the server this script starts")
    p.add_argument("--backend", default="auto")
    p.add_argument("--parallel", type=int, default=16, help="--parallel of the server this script starts")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for that server (repeat)")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment variable for that server (repeat), e.g. MALLOC_ARENA_MAX=2",
    )
    p.add_argument("--streams", type=int, default=200, help="concurrent clients")
    p.add_argument("--duration", type=float, default=1800, help="seconds of load (all rounds together)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="split the load into rounds, each followed by every client leaving and the server\n"
        "going idle; with more than one, the warm-up is the first round",
    )
    p.add_argument("--warmup", type=float, default=300, help="seconds before RSS growth is measured (one round)")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=256, help="largest max_tokens drawn")
    p.add_argument("--disconnect-share", type=float, default=0.3, help="streams the client cuts mid-way")
    p.add_argument("--bad-share", type=float, default=0.05, help="requests that are malformed")
    p.add_argument("--plain-share", type=float, default=0.1, help="well-formed requests that are not streamed")
    p.add_argument("--plain-max-tokens", type=int, default=32, help="largest max_tokens of a non-streamed request")
    p.add_argument(
        "--drain-timeout", type=float, default=300, help="seconds to wait after the load for requests_active to reach 0"
    )
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON path (default docs/results/soak_<backend>_<streams>x<min>m.json)")
    p.add_argument("--plot", type=Path, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--note", default="", help="conditions to record with the result")
    a = p.parse_args(argv)

    server = None
    started = time.time()
    if a.url:
        url, pid, ready = a.url.rstrip("/"), None, None
    else:
        args = [
            "--model",
            a.model,
            "--backend",
            a.backend,
            "--parallel",
            str(a.parallel),
            "--max-queue",
            str(max(64, 2 * a.streams)),
            *a.server_arg,
        ]
        server = Server(args, env=dict(kv.split("=", 1) for kv in a.server_env))
        url, pid, ready = server.url, server.pid, server.ready
        print(json.dumps({"event": "server", "url": url, "pid": pid, "args": args}), flush=True)
    rc_server = None
    try:
        series, tally, active, elapsed = asyncio.run(run(a, url, pid))
        health = httpx.get(url + "/health", timeout=30).json()
    finally:
        if server is not None:
            rc_server = server.stop()
    summary = summarize(series, tally, a, active, elapsed)
    if server is not None:
        summary["server_exit_code"] = rc_server
        summary["checks"]["server_exit_0"] = rc_server == 0
        summary["passed"] = all(summary["checks"].values())
    tag = f"soak_{(ready or {}).get('backend') or health.get('backend') or 'server'}_{a.streams}x{round(a.duration / 60)}m"
    out = a.out or ROOT / "docs" / "results" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    png = a.plot or out.with_suffix(".png")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    doc = {
        "kind": "soak",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "settings": settings,
        "server": ready or {"url": url},
        "model": health.get("model"),
        "backend": health.get("backend"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "note": a.note,
        "summary": summary,
        "final_health": health,
        "series": series,
    }
    out.write_text(json.dumps(doc, indent=1))
    try:
        title = (
            f"soak: {a.streams} streams, {a.duration / 60:.0f} min, {doc['backend']} {doc['model']} -- "
            f"ok {summary['ok']}, cancelled {summary['cancelled']}, failed {summary['failed']}, "
            f"RSS growth after warm-up {summary.get('rss_growth_after_warmup', float('nan')):+.1%}"
        )
        plot(series, summary, a, png, title)
    except ImportError as exc:  # matplotlib is in the dev extra
        print(f"no plot: {exc}", file=sys.stderr)
    brief = {k: v for k, v in summary.items() if k != "failures"}
    print(json.dumps({"event": "soak", "json": str(out), "png": str(png), **brief}), flush=True)
    for f in summary["failures"][:10]:
        print("failure:", json.dumps(f), file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
