"""`swiftlm bench serve` at several prompt lengths (``--prompt-tokens 8000,32000``), prompts sent as token ids
(``--prompt-ids``: the server sees exactly that many tokens), ``--results NAME`` (a stable JSON name), and
scripts/bench_kv_formats_serve.py, which drives it per KV format: the option parsing and workloads, a run
against the fake SSE server of test_bench_serve.py, one short run against the real server with a tiny model, and
the script's ratios, steady inter-token latency and acceptance in-process."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
from conftest import ROOT, needs_torch, run_cli

from swiftlm.bench.lengths import parse_lengths, results_path, single_length
from swiftlm.bench.serve import add_arguments, build_workload, load_tokenizer, main

pytest.importorskip("httpx")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--base-url", "x", "--concurrency", "1", *argv])


def test_prompt_lengths_parse():
    assert parse_lengths("4000") == [4000]
    assert parse_lengths("8000, 32000,131072") == [8000, 32000, 131072]
    assert parse_lengths(12) == [12]
    for bad in ("", "8k", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lengths(bad)
    assert _args().prompt_tokens == [40]  # the default: one length, as before
    assert _args("--prompt-tokens", "5,9").prompt_tokens == [5, 9]
    assert single_length([7]) == 7 and single_length(7) == 7
    with pytest.raises(ValueError):
        single_length([5, 9])
    assert results_path("docs/results", "kv_cpu").as_posix() == "docs/results/kv_cpu.json"
    for bad in ("a/b", "..", ""):
        with pytest.raises(ValueError):
            results_path("docs/results", bad)


def test_prompt_ids_workload_has_exact_lengths():
    """Token-id prompts: exactly the length asked for (warmup requests their own), ids from the tokenizer's
    non-special vocabulary, the same ids for the same seed."""
    tok = load_tokenizer(None)
    args = _args(
        "--endpoint",
        "completions",
        "--prompt-ids",
        "--prompt-tokens",
        "7,300",
        "--num-requests",
        "3",
        "--warmup",
        "2",
        "--warmup-prompt-tokens",
        "4",
    )
    for n in (7, 300):
        w = build_workload(args, tok, n)
        assert [x.index for x in w] == [-2, -1, 0, 1, 2]
        assert [len(x.payload["prompt"]) for x in w] == [4, 4, n, n, n]
        special = set(getattr(tok, "special_ids", ()) or ())
        assert all(
            isinstance(t, int) and 0 <= t < tok.vocab_size and t not in special for x in w for t in x.payload["prompt"]
        )
        assert [x.payload for x in build_workload(args, tok, n)] == [x.payload for x in w]  # seeded
    with pytest.raises(ValueError):  # several lengths: build_workload needs the one to build
        build_workload(args, tok)


def test_lengths_run_against_fake_server(tmp_path, capsys):
    """Two lengths, two requests each: one table, a document per length under --results, the request bodies
    carrying prompts of exactly those lengths; inconsistent options are refused."""
    from test_bench_serve import FakeSSE

    srv = FakeSSE()
    try:
        common = ["--base-url", srv.base, "--concurrency", "1", "--num-requests", "2", "--output-tokens", "4"]
        argv = [*common, "--endpoint", "completions", "--prompt-ids", "--prompt-tokens", "5,9", "--no-progress"]
        rc = main(
            [*argv, "--results", "lengths_test", "--results-dir", str(tmp_path), "--json", str(tmp_path / "x.json")]
        )
        out = capsys.readouterr().out
        assert rc == 0, out
        assert "by prompt" in out and "TTFT" in out and "ITL" in out
        assert [len(b["prompt"]) for b in srv.bodies] == [5, 5, 9, 9]
        doc = json.loads((tmp_path / "lengths_test.json").read_text())
        assert doc == json.loads((tmp_path / "x.json").read_text())
        assert doc["config"]["prompt_tokens"] == [5, 9] and doc["config"]["prompt_ids"] is True
        assert [x["prompt_tokens"] for x in doc["lengths"]] == [5, 9]
        for x in doc["lengths"]:
            s = x["summary"]
            assert s["requests_ok"] == 2 and s["requests_failed"] == 0 and len(x["requests"]) == 2
            assert s["server_prompt_tokens"] == 5  # what the fake server reports in usage
            for k in ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "stream_tok_s"):
                assert s[k] is not None and s[k] >= 0, k
            assert x["results"]["ttft_ms"]["n"] == 2
        # one length: the one-run --json document, as before
        assert main([*common, "--prompt-tokens", "6", "--no-progress", "--json", str(tmp_path / "one.json")]) == 0
        one = json.loads((tmp_path / "one.json").read_text())
        assert set(one) == {"config", "results", "requests"} and one["config"]["prompt_tokens"] == 6
        assert main([*common, "--prompt-ids", "--no-progress"]) == 2  # chat endpoint: refused
        assert main([*common, "--results", "a/b", "--no-progress"]) == 2
    finally:
        srv.close()
    assert "--prompt-ids sends random token ids" in capsys.readouterr().err


def _kv_script():
    spec = importlib.util.spec_from_file_location(
        "bench_kv_formats_serve", ROOT / "scripts" / "bench_kv_formats_serve.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kv_formats_ratios():
    """Ratios to 16-bit per length: TTFT and ITL as the format's over 16-bit's, decode as 16-bit's ITL over the
    format's; each number the median over rounds."""
    m = _kv_script()

    def row(n, ttft, itl50, itl99):
        return {"prompt_tokens": n, "ttft_ms_p50": ttft, "itl_ms_p50": itl50, "itl_ms_p99": itl99, "requests_ok": 1}

    rounds = {
        "16bit": [[row(100, 10.0, 2.0, 4.0)], [row(100, 12.0, 2.0, 6.0)], [row(100, 14.0, 2.0, 5.0)]],
        "k4v3": [[row(100, 13.0, 2.5, 5.0)], [row(100, 11.0, 2.5, 5.0)], [row(100, 30.0, 2.0, 5.0)]],
    }
    rows = {k: m.median_rows(v) for k, v in rounds.items()}
    assert rows["16bit"][0]["ttft_ms_p50"] == 12.0 and rows["k4v3"][0]["ttft_ms_p50"] == 13.0
    assert rows["k4v3"][0]["rounds"] == 3 and rows["k4v3"][0]["requests_ok"] == 1
    r = m.ratios(rows)["k4v3"][0]
    assert r["ttft"] == pytest.approx(13 / 12) and r["itl_p50"] == pytest.approx(1.25)
    assert r["decode"] == pytest.approx(0.8) and r["itl_p99"] == pytest.approx(1.0)
    assert m.ratios(rows)["16bit"][0]["ttft"] == 1.0
    # the median of each round's ratios: rounds 13/10, 11/12, 30/14 -> 1.3
    rr = m.round_ratios(rounds)
    assert rr["k4v3"][0]["ttft"] == pytest.approx(1.3) and rr["k4v3"][0]["decode"] == pytest.approx(0.8)
    assert rr["16bit"][0]["ttft"] == 1.0


@needs_torch
def test_prompt_ids_reach_the_real_server_exactly(tiny_llama, monkeypatch):
    """The server's own count of the prompt (usage.prompt_tokens) is the length sent, at each length."""
    from server_util import ServerProc

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    srv = ServerProc("--model", str(tiny_llama), "--backend", "torch", "--parallel", "1")
    try:
        r = run_cli(
            *("bench", "serve", "--base-url", srv.base, "--concurrency", "1", "--num-requests", "1"),
            *("--endpoint", "completions", "--prompt-ids", "--prompt-tokens", "16,48", "--tokenizer", str(tiny_llama)),
            *("--output-tokens", "4", "--ignore-eos", "--no-progress", "--results", "lengths"),
            *("--results-dir", str(tiny_llama.parent / "res")),
            timeout=300,
        )
    finally:
        assert srv.stop() == 0, srv.stderr_tail()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((tiny_llama.parent / "res" / "lengths.json").read_text())
    assert [(x["summary"]["prompt_tokens"], x["summary"]["server_prompt_tokens"]) for x in doc["lengths"]] == [
        (16, 16),
        (48, 48),
    ]


def test_steady_itl_keeps_the_gaps_where_every_stream_decodes():
    """Two streams: the first streams alone before the second's first token (its gaps there are dropped), both
    stream together until the first one ends; gaps straddling either edge are dropped too."""
    m = _kv_script()
    a = {"ok": True, "send_s": 0.0, "chunk_ms": [10.0, 20.0, 30.0, 40.0, 45.0, 50.0]}
    b = {"ok": True, "send_s": 0.025, "chunk_ms": [10.0, 15.0, 20.0, 40.0]}  # absolute 35, 40, 45, 65
    assert m.steady_itl([a, b]) == [5.0] * 4  # window [35, 50]: a's 40-45, 45-50; b's 35-40, 40-45 (not 45-65)
    assert m.steady_itl([a, {**b, "ok": False}]) == [10.0, 10.0, 10.0, 5.0, 5.0]  # one stream: all its gaps
    assert m.steady_itl([]) == []


def test_kv_formats_script_main(tmp_path, monkeypatch, capsys):
    """scripts/bench_kv_formats_serve.py in-process, with its server and client replaced (the real HTTP path is
    test_prompt_ids_reach_the_real_server_exactly's): a server per format and round with the format's flags, the
    request fields sent, --streams adding a row of the longest length, every compressed format (kv_bits too)
    held to the acceptance ratios, the JSON named after the tag."""
    m = _kv_script()
    started = []
    itl = {"16bit": 10.0, "k4v3": 9.0, "kv8": 12.0}  # kv8 decodes slower than 0.9x of 16-bit: it fails

    class FakeServer:
        def __init__(self, args, flags, log):
            started.append((flags, args.streams))

        def stop(self):
            pass

    sent = []

    def fake_bench(args, srv, fields, out, streams=1, lengths=None):
        sent.append(fields)
        name = fields.get("turbo_kv") or ("kv8" if fields else "k4v3" if started[-1][0] else "16bit")
        rows = []
        for n in lengths or args.prompt_tokens:
            row = {"prompt_tokens": n, "ttft_ms_p50": n / 10, "itl_ms_p50": itl[name], "itl_ms_p99": 2 * itl[name]}
            rows.append({**row, "steady_itl_ms_p50": itl[name] * streams, "requests_ok": 1})
        return rows

    monkeypatch.setattr(m, "Server", FakeServer)
    monkeypatch.setattr(m, "bench", fake_bench)
    argv = ["x", "--formats", "k4v3,kv8,16bit", "--prompt-tokens", "100,400", "--rounds", "2", "--streams", "3"]
    monkeypatch.setattr("sys.argv", [*argv, "--tag", "t", "--out", str(tmp_path), "--note", "idle", "--check"])
    assert m.main() == 1  # kv8 misses the decode ratio
    out = capsys.readouterr().out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith(("k4v3", "kv8"))] == ["ok"] * 3 + ["FAIL"] * 3
    assert started == [([], 3), (["--turbo-kv", "k4v3"], 3), ([], 3)] * 2  # 16-bit first, then in the order given
    doc = json.loads((tmp_path / "kv_formats_serve_t.json").read_text())
    assert list(doc["rows"]) == ["16bit", "k4v3", "kv8"] and doc["config"]["note"] == "idle"
    assert [(r["prompt_tokens"], r["streams"]) for r in doc["rows"]["k4v3"]] == [(100, 1), (400, 1), (400, 3)]
    r = doc["ratios"]["kv8"]
    assert [x["decode"] for x in r[:2]] == [10 / 12] * 2 and r[2]["steady_decode"] == 10 / 12
    assert doc["ratios"]["k4v3"][0]["ttft"] == 1.0 and doc["accepted"] is False
    # --one-server: one 16-bit server, the format chosen by each request's fields
    started.clear(), sent.clear()
    monkeypatch.setattr("sys.argv", [*argv[:-2], "--one-server", "--tag", "u", "--out", str(tmp_path)])
    assert m.main() == 0  # no --check
    assert started == [([], 1)]
    assert sent == [{}, {"turbo_kv": "k4v3"}, {"kv_bits": 8}] * 2
    assert json.loads((tmp_path / "kv_formats_serve_u.json").read_text())["config"]["one_server"] is True


def test_churn_steps_summary_leaves_out_the_warm_up(tmp_path):
    """bench_serve_churn's step figures: durations to the next step, the median decode-only step, stalls over the
    bound counted beyond that median; the steps before the server was ready (its start-up warm-up) left out."""
    spec = importlib.util.spec_from_file_location("bench_serve_churn", ROOT / "scripts" / "bench_serve_churn.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)

    def step(t, decode, pre=0):
        return json.dumps({"t": t, "decode": decode, "prefill_seqs": int(pre > 0), "prefill_tokens": pre})

    # warm-up: a mixed step of 5 s (a compile); then decode steps of 10 ms, one mixed step of 200 ms, one of 100 ms
    lines = [step(0.0, 1, 512), step(5.0, 1), step(5.01, 1), step(5.02, 1, 512), step(5.22, 1), step(5.23, 1, 300),
             step(5.33, 1), step(5.34, 1), step(5.35, 0)]  # fmt: skip
    log = tmp_path / "serve_x_steps_1.jsonl"
    log.write_text("\n".join(lines) + "\n{cut")
    everything = m.steps_summary([log], 75.0)
    assert everything["stalls"] == 3 and everything["worst_step_ms"] == pytest.approx(5000.0)
    ready = m.steps_summary([log], 75.0, since=5.0)
    assert ready["steps_before_ready"] == 1 and ready["decode_steps"] == 5
    assert ready["decode_step_ms_p50"] == pytest.approx(10.0)
    assert ready["stalls"] == 2 and ready["worst_step_ms"] == pytest.approx(200.0)
    assert ready["stall_ms_lost"] == pytest.approx(190.0 + 90.0)
