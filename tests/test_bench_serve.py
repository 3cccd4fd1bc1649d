"""`swiftlm bench serve`: the pure functions (hand-computed values), the client's timing against a fake SSE
server with known delays, its capacity against one that streams instantly, and a run against the real server."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
from conftest import needs_torch, run_cli

from swiftlm.bench.serve import (
    ClientConfig,
    RequestRecord,
    Workload,
    chunk_content,
    chunk_token_counts,
    describe,
    itl_samples,
    merge_parts,
    parse_sse_line,
    percentile,
    poisson_arrivals,
    random_prompt,
    run_requests,
    sample_lengths,
    split_share,
    summarize,
    tpot,
)

pytest.importorskip("httpx")


# =========================================================================== pure functions
def test_percentile_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4; rank = (n-1) p / 100
    assert percentile(xs, 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)
    d = describe([0.010, 0.020, 0.030], scale=1e3)  # seconds -> ms
    assert d["mean"] == pytest.approx(20.0) and d["p50"] == pytest.approx(20.0)
    assert d["p90"] == pytest.approx(28.0) and d["p99"] == pytest.approx(29.8)  # ranks 1.8, 1.98
    assert (d["min"], d["max"], d["n"]) == (pytest.approx(10.0), pytest.approx(30.0), 3)
    assert describe([])["p50"] is None and describe([])["n"] == 0


def test_chunk_token_counts_spread():
    assert chunk_token_counts(4, 4) == [1, 1, 1, 1]
    # 10 tokens over 4 chunks: cumulative floor(10*(i+1)/4) = 2, 5, 7, 10
    assert chunk_token_counts(4, 10) == [2, 3, 2, 3]
    # fewer tokens than chunks: cumulative max(1, floor(2*(i+1)/4)) = 1, 1, 1, 2
    assert chunk_token_counts(4, 2) == [1, 0, 0, 1]
    assert chunk_token_counts(3, 0) == [1, 0, 0] and chunk_token_counts(0, 5) == []


def test_itl_one_token_per_chunk_is_the_gaps():
    times = [0.100, 0.150, 0.250, 0.300]
    assert itl_samples(times, 4) == pytest.approx([0.050, 0.100, 0.050])
    assert tpot(times, 4) == pytest.approx(0.200 / 3)


def test_itl_multi_token_chunks_are_spread():
    times = [0.100, 0.150, 0.250, 0.300]
    # 7 tokens over 4 chunks: counts 1, 2, 2, 2 (cumulative 1, 3, 5, 7); each gap split over its chunk's tokens
    assert chunk_token_counts(4, 7) == [1, 2, 2, 2]
    s = itl_samples(times, 7)
    assert s == pytest.approx([0.025, 0.025, 0.050, 0.050, 0.025, 0.025])
    assert sum(s) == pytest.approx(0.300 - 0.100) and len(s) == 7 - 1
    assert tpot(times, 7) == pytest.approx(0.200 / 6)
    # a zero-token chunk carries its gap into the next chunk: counts 1, 0, 0, 1 -> one sample of 0.2
    assert itl_samples(times, 2) == pytest.approx([0.200])
    assert itl_samples([0.1], 5) == [] and tpot([0.1], 5) is None and tpot([], 0) is None


def test_lengths_arrivals_split():
    rng = random.Random(0)
    assert sample_lengths(rng, 40, 0, 3) == [40, 40, 40]
    got = sample_lengths(random.Random(1), 40, 10, 200)
    assert min(got) >= 1 and 35 < sum(got) / len(got) < 45 and len(set(got)) > 10

    class FixedGaps:  # exponential gaps replaced by their mean: arrivals 0, 1/r, 2/r ...
        def expovariate(self, rate):
            return 1.0 / rate

    assert poisson_arrivals(FixedGaps(), 2.0, 4) == pytest.approx([0.0, 0.5, 1.0, 1.5])
    a = poisson_arrivals(random.Random(3), 10.0, 2000)
    assert a[0] == 0.0 and 0.09 < a[-1] / 1999 < 0.11  # mean gap 1/rate
    assert split_share(7, 3) == [3, 2, 2] and split_share(4, 4) == [1, 1, 1, 1]


def test_random_prompt_exact_length_with_char_tokenizer():
    alphabet = "abcdefghij"  # one token per character: decode -> encode is exact

    def enc(s):
        return [alphabet.index(c) for c in s]

    def dec(ids):
        return "".join(alphabet[i] for i in ids)

    text = random_prompt(enc, dec, list(range(10)), 25, random.Random(0))
    assert len(text) == 25 and set(text) <= set(alphabet)
    assert text == random_prompt(enc, dec, list(range(10)), 25, random.Random(0))  # seeded

    # "ab" encodes as one token (id 10), so decode -> encode can come back shorter: the rounds pad until it holds
    def enc_merge(s):
        out, i = [], 0
        while i < len(s):
            if s.startswith("ab", i):
                out.append(10)
                i += 2
            else:
                out.append(alphabet.index(s[i]))
                i += 1
        return out

    def dec_merge(ids):
        return "".join("ab" if i == 10 else alphabet[i] for i in ids)

    texts = [random_prompt(enc_merge, dec_merge, list(range(10)), 30, random.Random(s)) for s in range(20)]
    assert any("ab" in t for t in texts)
    assert all(len(enc_merge(t)) == 30 for t in texts)


def test_random_prompt_with_bundled_tokenizer():
    from swiftlm.bench.serve import load_tokenizer

    tok = load_tokenizer(None)
    assert tok.eos_token_ids and max(tok.eos_token_ids) < tok.vocab_size
    allowed = [i for i in range(tok.vocab_size) if i not in tok.special_ids]
    lens = [len(tok.encode(random_prompt(tok.encode, tok.decode, allowed, 40, random.Random(s)))) for s in range(5)]
    assert all(abs(n - 40) <= 2 for n in lens), lens


def test_workload_from_dataset_and_random(tmp_path):
    import argparse

    from swiftlm.bench.serve import add_arguments, build_workload, load_tokenizer

    ds = tmp_path / "p.jsonl"
    ds.write_text(
        json.dumps({"prompt": "Hello", "max_tokens": 5})
        + "\n\n"
        + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    )
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--base-url",
            "x",
            "--concurrency",
            "1",
            "--num-requests",
            "3",
            "--warmup",
            "1",
            "--dataset",
            str(ds),
            "--output-tokens",
            "9",
        ]
    )
    w = build_workload(args, None)  # warmup first (index -1), then the dataset again from where it left off
    assert [x.index for x in w] == [-1, 0, 1, 2]
    assert w[0].payload == {"messages": [{"role": "user", "content": "Hello"}]} and w[0].max_tokens == 5
    assert w[1].payload["messages"][0] == {"role": "system", "content": "s"} and w[1].max_tokens == 9
    assert w[2].payload == w[0].payload
    args.endpoint = "completions"
    with pytest.raises(Exception, match="line 3 has 'messages'"):
        build_workload(args, None)
    args = p.parse_args(
        [
            "--base-url",
            "x",
            "--concurrency",
            "1",
            "--num-requests",
            "4",
            "--prompt-tokens",
            "12",
            "--output-tokens",
            "20",
            "--output-tokens-std",
            "5",
            "--endpoint",
            "completions",
        ]
    )
    tok = load_tokenizer(None)
    w = build_workload(args, tok)
    assert all(abs(len(tok.encode(x.payload["prompt"])) - 12) <= 2 for x in w)
    assert [x.max_tokens for x in w] == [x.max_tokens for x in build_workload(args, tok)]  # seeded
    assert len({x.max_tokens for x in w}) > 1


def test_sse_parsing_and_content():
    assert parse_sse_line(b'data: {"a": 1}') == ("data", {"a": 1})
    assert parse_sse_line(b"data: [DONE]") == ("done", None)
    assert parse_sse_line(b": keep-alive") == ("skip", None) and parse_sse_line(b"") == ("skip", None)
    assert chunk_content({"choices": [{"delta": {"content": "hi"}}]})
    assert not chunk_content({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert chunk_content({"choices": [{"delta": {"reasoning_content": "hm"}}]})
    assert chunk_content({"choices": [{"text": "x", "index": 0}]})  # /v1/completions
    assert not chunk_content({"choices": [], "usage": {"completion_tokens": 3}})


def test_summarize_and_merge():
    a = RequestRecord(
        index=0,
        ok=True,
        send=0.0,
        ttft=0.1,
        e2e=0.4,
        output_tokens=4,
        prompt_tokens=10,
        usage_reported=True,
        chunk_times=[0.1, 0.2, 0.3, 0.4],
    )
    b = RequestRecord(
        index=1,
        ok=True,
        send=0.5,
        ttft=0.2,
        e2e=0.5,
        output_tokens=3,
        prompt_tokens=12,
        usage_reported=True,
        chunk_times=[0.2, 0.35, 0.5],
    )
    c = RequestRecord(index=2, ok=False, error="HTTP 500: boom", send=0.1, e2e=0.05)
    r = summarize([a, b, c])
    assert r["requests_ok"] == 2 and r["requests_failed"] == 1 and r["errors"] == {"HTTP 500: boom": 1}
    assert r["duration_s"] == pytest.approx(1.0)  # first send 0.0, last finish 0.5 + 0.5
    assert r["total_output_tokens"] == 7 and r["output_throughput"] == pytest.approx(7.0)
    assert r["request_throughput"] == pytest.approx(2.0) and r["total_prompt_tokens"] == 22
    assert r["ttft_ms"]["mean"] == pytest.approx(150.0)
    # ITL samples (ms): a -> 100, 100, 100; b -> 150, 150; p50 of [100,100,100,150,150] = 100
    assert r["itl_ms"]["n"] == 5 and r["itl_ms"]["mean"] == pytest.approx(120.0)
    assert r["itl_ms"]["p50"] == pytest.approx(100.0) and r["itl_ms"]["p90"] == pytest.approx(150.0)
    # stream tok/s: a 3 tokens in 0.3 s = 10; b 2 in 0.3 s = 6.667; mean 8.333
    assert r["mean_stream_tok_s"] == pytest.approx((10 + 20 / 3) / 2)
    assert r["e2e_ms"]["p50"] == pytest.approx(450.0)
    # two workers that started 0.25 s apart on the wall clock: their send times land on one clock
    merged = merge_parts([(100.25, [b]), (100.0, [a, c])])
    assert [m.index for m in merged] == [0, 1, 2]
    assert merged[1].send == pytest.approx(0.75) and merged[0].send == 0.0
    assert summarize(merged)["duration_s"] == pytest.approx(1.25)
    rt = RequestRecord.from_json(a.to_json())
    assert rt == a and a.to_json()["stream_tok_s"] == pytest.approx(10.0)


# =========================================================================== a fake SSE server
class FakeSSE:
    """A minimal HTTP/1.1 keep-alive server on a thread: GET /v1/models lists "fake"; any POST streams an
    OpenAI-style chat completion: a role
    chunk, then ``max_tokens / per_chunk`` content chunks (``ttft`` before the first, ``itl`` between), a usage
    chunk (``usage=False``: none) and [DONE].  ``itl == ttft == 0``: the whole response in one write."""

    def __init__(self, ttft: float = 0.0, itl: float = 0.0, per_chunk: int = 1, usage: bool = True):
        self.ttft, self.itl, self.per_chunk, self.usage = ttft, itl, per_chunk, usage
        self.bodies: list[dict] = []
        self.writes: dict[str, list[float]] = {}  # last message's content -> when each content chunk was written
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        assert ready.wait(10)
        self.base = f"http://127.0.0.1:{self.port}"

    def _serve(self, ready):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    def close(self):
        async def shutdown():
            self.server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    @staticmethod
    def _chunk(obj) -> bytes:
        ev = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        return b"%x\r\n%s\r\n" % (len(ev), ev)

    async def _conn(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = json.loads(await reader.readexactly(length)) if length else {}
                if head.startswith(b"GET /v1/models"):
                    models = json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(models), models)
                    )
                    continue
                self.bodies.append(body)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                n = int(body.get("max_tokens", 16))
                base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
                out = [
                    self._chunk(
                        {
                            **base,
                            "choices": [
                                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                            ],
                        }
                    )
                ]
                content = [
                    self._chunk(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"content": " tok" * self.per_chunk},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                    for _ in range(n // self.per_chunk)
                ]
                tail = (
                    [
                        self._chunk(
                            {
                                **base,
                                "choices": [],
                                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5},
                            }
                        )
                    ]
                    if self.usage
                    else []
                )
                tail += [self._chunk(b"[DONE]"), b"0\r\n\r\n"]
                if self.ttft == 0 and self.itl == 0:
                    writer.write(b"".join(out + content + tail))
                else:
                    writer.write(b"".join(out))
                    await writer.drain()
                    msgs = body.get("messages") or [{}]
                    written = self.writes.setdefault(str(msgs[-1].get("content")), [])
                    for i, c in enumerate(content):
                        await asyncio.sleep(self.ttft if i == 0 else self.itl)
                        written.append(time.time())  # before the write: the client cannot read it any earlier
                        writer.write(c)
                        await writer.drain()
                    writer.write(b"".join(tail))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def _work(n: int, max_tokens: int) -> list[Workload]:
    return [Workload(i, {"messages": [{"role": "user", "content": f"req {i}"}]}, max_tokens) for i in range(n)]


def test_timing_against_known_delays():
    """Server: 200 ms to the first content chunk, then 40 ms between 10 chunks; it also notes when it really
    wrote each chunk (time.time(), the clock the client's start is reported on: same process).

    Checked: every TTFT is at least the 200 ms delay (the clock starts before the request is sent) and every E2E
    at least 200 + 9 x 40 ms; the client's TTFT exceeds the server's real first write (seen from the client's
    send) by 0..20 ms, and its ITL median is within +-20 ms of the server's real gaps and of 40 ms.  The 20 ms
    covers loopback and event-loop latency (well under 1 ms on an idle machine), the GIL shared with the server
    thread (switch interval 5 ms) and two cores shared with other work (a runnable process can wait several
    scheduler slices); medians keep one late wake-up from failing the test.  The server's own sleep overshoot
    is left out of the client's error by comparing with its real write times."""
    srv = FakeSSE(ttft=0.200, itl=0.040)
    try:
        cfg = ClientConfig(base_url=srv.base, model="fake", concurrency=2, eos_bias_ids=[2], ignore_eos_field=True)
        start, recs = asyncio.run(run_requests(cfg, _work(4, 10)))
    finally:
        srv.close()
    assert all(r.ok for r in recs) and len(recs) == 4, [r.error for r in recs]
    body = srv.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["logit_bias"] == {"2": -100} and body["max_tokens"] == 10
    res = summarize(recs)
    ttft_err, itl_true = [], []
    for r in recs:
        assert r.output_tokens == 10 and r.usage_reported and r.prompt_tokens == 5 and len(r.chunk_times) == 10
        assert r.ttft >= 0.199 and r.e2e >= 0.200 + 9 * 0.040, (r.ttft, r.e2e)
        writes = srv.writes[f"req {r.index}"]
        ttft_err.append(r.ttft - (writes[0] - (start + r.send)))
        itl_true += [b - a for a, b in zip(writes, writes[1:])]
    print(
        "ttft ms",
        res["ttft_ms"],
        "itl ms",
        res["itl_ms"],
        "client ttft - server ttft ms",
        [round(e * 1e3, 2) for e in ttft_err],
    )
    assert all(-0.001 <= e for e in ttft_err) and percentile(ttft_err, 50) <= 0.020, ttft_err
    assert res["itl_ms"]["n"] == 4 * 9
    assert abs(res["itl_ms"]["p50"] - percentile(itl_true, 50) * 1e3) <= 20.0, (res["itl_ms"], itl_true)
    assert abs(res["itl_ms"]["p50"] - 40.0) <= 20.0, res["itl_ms"]


def test_multi_token_chunks_and_missing_usage():
    srv = FakeSSE(ttft=0.050, itl=0.040, per_chunk=2)  # 8 tokens in 4 chunks of 2
    try:
        cfg = ClientConfig(base_url=srv.base, model="fake", concurrency=1)
        _, recs = asyncio.run(run_requests(cfg, _work(1, 8)))
    finally:
        srv.close()
    (r,) = recs
    assert r.ok and r.output_tokens == 8 and len(r.chunk_times) == 4
    assert "ignore_eos" not in srv.bodies[0] and "logit_bias" not in srv.bodies[0]
    s = itl_samples(r.chunk_times, r.output_tokens)  # counts 2, 2, 2, 2: each later chunk's gap split in two
    # from the recorded arrival times, not from the server's sleeps (a loaded machine stretches those)
    gaps = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    assert s == pytest.approx([g / 2 for g in gaps for _ in range(2)]) and all(g > 0 for g in gaps)

    srv = FakeSSE(ttft=0.0, itl=0.0, usage=False)
    try:
        _, recs = asyncio.run(run_requests(ClientConfig(base_url=srv.base, model="fake", concurrency=1), _work(2, 5)))
        _, bad = asyncio.run(
            run_requests(ClientConfig(base_url=srv.base + "0", model="fake", concurrency=1, timeout=2), _work(1, 5))
        )
    finally:
        srv.close()
    assert all(r.ok and r.output_tokens == 5 and not r.usage_reported for r in recs)  # counted chunks
    assert not bad[0].ok and bad[0].error


def test_client_capacity():
    """Chunks per second one client process consumes from a server that writes each whole response at once
    (the server's cost is one write per request).  Printed; the floor asserted is far below what it does."""
    srv = FakeSSE()
    try:
        cfg = ClientConfig(base_url=srv.base, model="fake", concurrency=4)
        t = time.perf_counter()
        _, recs = asyncio.run(run_requests(cfg, _work(8, 4000)))
        wall = time.perf_counter() - t
    finally:
        srv.close()
    chunks = sum(len(r.chunk_times) for r in recs)
    assert all(r.ok for r in recs) and chunks == 8 * 4000
    print(f"client capacity: {chunks / wall:,.0f} content chunks/s")
    assert chunks / wall > 5000


def test_workers_merge_their_records():
    from swiftlm.bench.serve import run_workers

    srv = FakeSSE(ttft=0.020, itl=0.005)
    done = []
    try:
        cfg = ClientConfig(base_url=srv.base, model="fake", concurrency=3)
        recs = run_workers(cfg, _work(6, 4), 2, on_done=done.append)
    finally:
        srv.close()
    assert [r.index for r in recs] == list(range(6)) and all(r.ok and r.output_tokens == 4 for r in recs)
    assert done == [True] * 6 and len(srv.bodies) == 6
    assert min(r.send for r in recs) < 0.5  # one clock: both workers start at about the same moment


def test_workers_start_together():
    """--workers processes that get ready at different times (one 0.8 s late here; spawned processes differ by
    a few hundred ms on their own) still send their first requests at the same moment."""
    from swiftlm.bench.serve import run_workers

    srv = FakeSSE(ttft=0.010, itl=0.002)
    try:
        cfg = ClientConfig(base_url=srv.base, model="fake", concurrency=2)
        recs = run_workers(cfg, _work(4, 3), 2, start_delays=[0.0, 0.8])
    finally:
        srv.close()
    assert all(r.ok for r in recs) and len(recs) == 4
    first = [min(r.send for r in recs if r.index % 2 == k) for k in (0, 1)]  # requests are dealt round-robin
    assert abs(first[0] - first[1]) < 0.2, first


# =========================================================================== the real server
@needs_torch
def test_bench_serve_against_real_server(tmp_path, monkeypatch):
    from server_util import ServerProc

    # one torch thread: on a few cores shared with other jobs, two intra-op threads stall each other and slow
    # decode down many times over; alone on the machine one thread costs little
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    srv = ServerProc("--backend", "torch", "--parallel", "4")
    try:
        out = tmp_path / "bench.json"
        r = run_cli(
            "bench",
            "serve",
            "--base-url",
            srv.base,
            "--concurrency",
            "4",
            "--num-requests",
            "8",
            "--output-tokens",
            "16",
            "--prompt-tokens",
            "24",
            "--ignore-eos",
            "--no-progress",
            "--json",
            str(out),
            timeout=300,
        )
    finally:
        assert srv.stop() == 0, srv.stderr_tail()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "output tok/s" in r.stdout
    d = json.loads(out.read_text())
    assert set(d) == {"config", "results", "requests"}
    c, res, reqs = d["config"], d["results"], d["requests"]
    for k in (
        "base_url",
        "model",
        "concurrency",
        "num_requests",
        "prompt_tokens",
        "output_tokens",
        "date",
        "swiftlm_version",
        "host",
        "eos_ids",
        "ignore_eos",
    ):
        assert k in c
    assert c["model"] == srv.ready["model"] and c["concurrency"] == 4 and c["eos_ids"]
    for k in (
        "requests_ok",
        "requests_failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "total_output_tokens",
        "mean_stream_tok_s",
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "e2e_ms",
        "errors",
    ):
        assert k in res
    for k in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(res[k]) == {"mean", "p50", "p90", "p99", "min", "max", "n"} and res[k]["p50"] > 0
    assert res["requests_ok"] == 8 and res["requests_failed"] == 0 and len(reqs) == 8
    assert all(q["ok"] and q["output_tokens"] == 16 and q["usage_reported"] for q in reqs)
    assert res["total_output_tokens"] == 8 * 16
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration_s"], rel=1e-12)
    assert res["itl_ms"]["n"] > 0 and res["ttft_ms"]["n"] == 8
