"""scripts/trace_gaps.py on a small synthetic chrome trace: device gaps are split into host-late (the next
kernel's launch call ended after the device went idle) and device-wait (it was queued before), and the host ops
running during host-late gaps are attributed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from trace_gaps import analyse  # noqa: E402


def _x(cat, name, ts, dur, tid, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_host_late_and_device_wait(tmp_path):
    ev = [
        _x("cuda_runtime", "cudaLaunchKernel", 0, 5, 1, 1),
        _x("kernel", "k1", 10, 20, 7, 1),  # busy 10-30
        _x("cpu_op", "aten::foo", 25, 40, 1),  # host busy 25-65
        _x("cuda_runtime", "cudaGraphLaunch", 60, 10, 1, 2),
        _x("kernel", "k2", 75, 20, 7, 2),  # launched at 70 > 30
        _x("cuda_runtime", "cudaLaunchKernel", 80, 2, 1, 3),
        _x("kernel", "k3", 120, 20, 7, 3),
    ]  # queued at 82 < 95
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    r = analyse(str(p), min_us=5)
    assert r["busy_us"] == 60 and r["span_us"] == 130 and r["idle_us"] == 70
    assert r["gaps"] == 2
    assert r["host_late_us"] == 45 and r["device_wait_us"] == 25
    assert r["host_late_by_launch_call"] == {"cudaGraphLaunch": 45}
    assert r["host_ops_during_late_gaps_us"] == {"aten::foo": 35}  # its overlap with the gap 30-75
    assert [g["kind"] for g in r["largest_gaps"]] == ["host-late", "device-wait"]
