"""The CI soak: a short smoke of scripts/soak.py (18 s of load, the first 10 the warm-up), 32 concurrent
clients against the tiny checkpoint on torch (streams with random disconnects, non-streamed requests, bad
requests).  Every well-formed request completes or is cancelled by its client, no 5xx, requests_active goes
back to 0, RSS after the warm-up stays within the limit, and Python objects do not pile up per request.
The long runs are scripts/soak.py's own: the 30-minute run with 200 streams on the bundled model is on the
benchmark page (docs/benchmarks.md, "Memory under load"; how to run it: docs/guide/measuring.md); a minute of
this same load is ``scripts/soak.py --model CKPT --backend torch --parallel 8 --streams 32 --duration 60
--warmup 25 --max-tokens 64`` plus the server options below (same checks; on the 2-core CI machine it measured
+2.0% RSS and +0.25% Python blocks after its warm-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, needs_torch


@needs_torch
@pytest.mark.timeout(600)
def test_soak_short(tiny_llama, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "soak.py"),
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--parallel",
        "8",
        "--streams",
        "32",
        "--duration",
        "18",
        "--warmup",
        "10",
        # 36 samples: the warm-up's peak and the RSS after it are each taken over many samples
        "--sample-every",
        "0.5",
        "--max-tokens",
        "64",
        # RSS after a short warm-up still settles for half a minute (glibc arenas, the allocator's pools, the
        # prompt cache filling): runs of this 18-s smoke measured +3% to +6% (also with another process busy on
        # one of the two cores), Python objects +0.1% to +0.3%, where the 30-minute soak settles at +1.5%.
        # 10% holds a gross leak; the 5% limit is the 30-minute soak's (scripts/soak.py's default).
        "--max-rss-growth",
        "0.10",
        # a prompt cache small enough to fill during the warm-up: its bytes are a bounded, wanted cost
        "--server-arg=--prompt-cache-bytes",
        "--server-arg=8000000",
        # glibc's dynamic mmap threshold otherwise keeps freed tensors in its arenas, a level
        # reached only after minutes (swiftlm.memory.tune_allocator pins the threshold the same way)
        "--server-env",
        "MALLOC_MMAP_THRESHOLD_=131072",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert out.exists(), r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert r.returncode == 0, json.dumps({k: v for k, v in s.items()}, indent=1)[-4000:] + r.stderr[-2000:]
    assert s["ok"] > 20 and s["cancelled"] > 0 and s["bad_rejected_4xx"] > 0
    assert s["failed"] == 0 and s["5xx"] == 0 and s["requests_active_after"] == 0
    assert s["checks"]["rss_growth_within_limit"] and s["server_exit_code"] == 0
    # a leak of Python objects per request shows within the smoke: its ~130-200 requests after the warm-up that
    # each kept 100 objects would add 1.3-2% to the ~1.04M live blocks
    assert s["python_blocks_growth_after_warmup"] <= 0.01, s
    assert len(doc["series"]) > 20 and all(row["rss"] > 0 for row in doc["series"])
    assert out.with_suffix(".png").stat().st_size > 10_000


def _soak_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak_script", ROOT / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _series(rss_at):
    return [
        {"t": float(t), "rss": rss_at(t), "phase": "load", "round": 0, "kv_allocated": 0, "prompt_cache_bytes": 0}
        for t in range(0, 1800, 5)
    ]


def test_rss_growth_is_peak_against_peak():
    """A load whose RSS swings +-5% around a flat level passes (the warm-up's peak is the level it
    swings to); a 1%-per-5-minutes trend on the same swing fails; the 'warm-up end' figure is
    still reported."""
    import argparse
    import math

    soak = _soak_module()
    a = argparse.Namespace(rounds=1, warmup=300.0, max_rss_growth=0.05)
    swing = lambda t: 1.0 + 0.05 * math.sin(t / 37.0)  # noqa: E731
    flat = soak.summarize(_series(lambda t: int(1e9 * swing(t))), soak.Tally(), a, 0, 1800.0)
    assert flat["rss_growth_after_warmup"] < 0.01 and flat["checks"]["rss_growth_within_limit"]
    assert "rss_growth_vs_warmup_end" in flat and len(flat["rss_windows"]) == 6
    trend = soak.summarize(_series(lambda t: int(1e9 * swing(t) * (1 + 0.01 * t / 300))), soak.Tally(), a, 0, 1800.0)
    assert trend["rss_growth_after_warmup"] > 0.04
    steeper = soak.summarize(_series(lambda t: int(1e9 * swing(t) * (1 + 0.02 * t / 300))), soak.Tally(), a, 0, 1800.0)
    assert not steeper["checks"]["rss_growth_within_limit"]
    assert [w["from_s"] for w in flat["rss_windows"]] == [0, 300, 600, 900, 1200, 1500]
