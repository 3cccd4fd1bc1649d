"""``swiftlm bench``: the configuration x context matrix, its JSON / Markdown / plots, and ``--compare``."""

from __future__ import annotations

import json

import pytest
from conftest import make_ckpt, needs_torch, run_cli

from swiftlm.bench.matrix import cap_contexts, expand_configs
from swiftlm.turboquant.presets import NAMED_PRESETS

SMALL = ("--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--dtype", "float32")


def test_configs_expand_presets_and_refuse_unknown_names():
    names = [c["name"] for c in expand_configs("vanilla,turbo,experts+turbo:k3v2,experts", True)]
    assert names == ["vanilla", *[f"turbo:{p}" for p in NAMED_PRESETS], "experts+turbo:k3v2", "experts"]
    both = expand_configs("experts+turbo:k3v2", True)[0]
    assert both["turbo"] == "k3v2" and both["experts"] is True
    for bad in ("turbo:k9v9", "fast", "experts+fast", ""):
        with pytest.raises(SystemExit):
            expand_configs(bad, False)


def test_contexts_are_capped_by_the_model():
    assert cap_contexts([512, 4096, 16384, 40960], 8192, 128) == [512, 4096, 8192 - 128 - 8]
    assert cap_contexts([64, 32, 64], 0, 16) == [32, 64]
    with pytest.raises(SystemExit):
        cap_contexts([64], 100, 128)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_ckpt(
        tmp_path_factory.mktemp("bench") / "moe",
        "--arch",
        "qwen3_moe",
        *SMALL,
        "--experts",
        "4",
        "--experts-per-token",
        "2",
        "--moe-intermediate",
        "32",
        "--ctx",
        "512",
    )


@needs_torch
def test_bench_matrix_on_a_moe_checkpoint(moe, tmp_path):
    out = tmp_path / "res"
    r = run_cli(
        "bench",
        "--model",
        str(moe),
        "--backend",
        "torch",
        "--configs",
        "vanilla,turbo:k4v3,experts",
        "--contexts",
        "96,200,4000",
        "--decode-tokens",
        "6",
        "--batch-sizes",
        "1,3",
        "--batch-context",
        "40",
        "--set",
        "turbo_kv_window=16",
        "--out",
        str(out),
        "--name",
        "m",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "m.json").read_text())
    meta = doc["meta"]
    assert meta["contexts"] == [96, 200, 512 - 6 - 8]  # 4000 capped to what the 512-token model holds
    by = {res["config"]: res["rows"] for res in doc["results"]}
    assert list(by) == ["vanilla", "turbo:k4v3", "experts"]
    ctx = {c: {x["context"]: x for x in rows if x["kind"] == "context"} for c, rows in by.items()}
    for c in by:
        assert sorted(ctx[c]) == meta["contexts"], c
        for x in ctx[c].values():
            assert x["tokens"] == 6 and x["prefill_tps"] > 0 and x["decode_tps"] > 0 and x["peak_rss_bytes"] > 0
        batch = [x for x in by[c] if x["kind"] == "batch"]
        assert [x["batch"] for x in batch] == [1, 3] and [x["tokens"] for x in batch] == [6, 18]
    loaded = next(x for x in by["vanilla"] if x["kind"] == "loaded")
    per_tok16 = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads, head_dim 64/4, 2 bytes
    for n, x in ctx["vanilla"].items():
        # the request held its prompt and (most of) its decoded tokens, in fp32 on the CPU
        assert n * per_tok16 <= x["kv_fp16_bytes"] <= (n + 6) * per_tok16, (n, x)
        assert x["kv_bytes"] == 2 * x["kv_fp16_bytes"] and loaded["kv_bytes_per_token"] == 2 * per_tok16
        # TurboQuant's rows beyond the 16-position window are compressed: fewer bytes than 16-bit (its code
        # storage grows in steps, so short contexts carry spare capacity; the longest is well under)
        t = ctx["turbo:k4v3"][n]
        assert t["kv_bytes"] < (0.5 if n == max(ctx["vanilla"]) else 1.0) * t["kv_fp16_bytes"], (n, t)
        # streamed experts compute what resident experts compute: the same greedy tokens
        assert ctx["experts"][n]["output_digest"] == x["output_digest"], n
    assert [x["output_digest"] for x in by["experts"] if x["kind"] == "batch"] == [
        x["output_digest"] for x in by["vanilla"] if x["kind"] == "batch"
    ]
    md = (out / "m.md").read_text()
    assert "| turbo:k4v3 | 96 |" in md and "| experts | 200 |" in md and "same" in md
    pytest.importorskip("matplotlib")
    for png in ("m_speed.png", "m_memory.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --compare of a run with itself: every ratio is 1.00x
    r = run_cli("bench", "--compare", str(out / "m.json"), str(out / "m.json"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    table = (out / "compare-m-vs-m.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| vanilla |")]
    assert len(rows) == 3 + 2 and all("1.00x" in ln for ln in rows)
    assert (out / "compare-m-vs-m_speed.png").exists()


@needs_torch
def test_bench_skips_streaming_on_a_dense_model_with_the_reason(tmp_path):
    dense = make_ckpt(tmp_path / "dense", "--arch", "llama", *SMALL, "--ctx", "256")
    r = run_cli(
        "bench",
        "--model",
        str(dense),
        "--backend",
        "torch",
        "--configs",
        "vanilla,experts",
        "--contexts",
        "32",
        "--decode-tokens",
        "3",
        "--batch-sizes",
        "2",
        "--no-plots",
        "--out",
        str(tmp_path / "o"),
        "--name",
        "d",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "o" / "d.json").read_text())
    experts = doc["results"][1]["rows"]
    assert [x["kind"] for x in experts] == ["skipped"] and "expert" in experts[0]["reason"].lower()
    assert "experts: skipped:" in (tmp_path / "o" / "d.md").read_text()
    assert not list((tmp_path / "o").glob("*.png"))


def test_compare_refuses_a_file_that_is_not_a_bench_result(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    r = run_cli("bench", "--compare", str(bad), str(bad), "--out", str(tmp_path))
    assert r.returncode == 2 and "is not a swiftlm bench JSON file" in r.stderr


def test_a_configuration_is_killed_at_its_timeout_mid_measurement():
    """The watchdog stops a worker stuck inside one measurement (not only between rows), keeps the rows it
    reported, and reports the timeout; a hung 100K-token prefill must not eat the whole matrix."""
    import sys
    import time

    from swiftlm.bench.matrix import _run_config

    script = (
        "import json, time; print(json.dumps({'kind': 'loaded', 'load_s': 0.1, 'device': 'cpu'}), flush=True);"
        " time.sleep(60)"
    )
    seen = []
    t0 = time.monotonic()
    rows = _run_config({}, 2.0, seen.append, cmd=[sys.executable, "-c", script])
    took = time.monotonic() - t0
    assert took < 20, took  # killed at ~2 s, not after the child's 60 s sleep
    assert [r["kind"] for r in rows] == ["loaded", "error"]
    assert "--timeout 2" in rows[-1]["reason"]
    assert seen == rows  # the caller saw every row as it came, the timeout included


def test_a_worker_that_crashes_reports_its_last_stderr_line():
    import sys

    from swiftlm.bench.matrix import _run_config

    rows = _run_config(
        {},
        30.0,
        lambda r: None,
        cmd=[sys.executable, "-c", "import sys; print('boom: out of memory', file=sys.stderr); sys.exit(3)"],
    )
    assert rows == [{"kind": "error", "reason": "the worker failed: boom: out of memory"}]
