"""The torch backend's numba kernels (compressed-KV decode on CPU) run on numba's OpenMP layer where it loads (its
loops then run on torch's own OpenMP threads), and starting that layer, which sets the process's OpenMP thread
count to every core, leaves torch and the kernels on OMP_NUM_THREADS threads (``cpu_kernels.start_pool``).
In subprocesses, a prompt chunk and decode rows over a TurboQuant and a kv_bits cache: with OMP_NUM_THREADS=2 torch
and numba stay at two threads, the kernels are the parallel ones, and the decode rows are bit-equal to those of the
workqueue layer (the user's choice is kept: same tasks, same split, same merge; both runs load the kernels from
numba's disk cache, as a kernel compiled in the process has differed from the cached one in the last bits); with OMP_NUM_THREADS=1 both stay at
one thread, the kernels are compiled without parallel loops (``cpu_attention.parallel``), and the rows agree with
the two-thread ones to fp32 rounding (another split of the rows, other summation orders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import needs_torch

pytest.importorskip("numba")

SCRIPT = textwrap.dedent("""
    import json, os, torch, numba
    from types import SimpleNamespace
    from swiftlm.backends.torch import cpu_kernels
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import affine, parse_turbo

    assert cpu_kernels.enabled()
    a = SimpleNamespace(layers=1, kv_heads=3, heads=9, head_dim=64)
    outs = []
    for fmt in (parse_turbo("k4v3", window=16), affine(8, 64)):
        c = CompressedCache(a, fmt, torch.float32, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        pos = 0
        with torch.inference_mode():
            for T in (600, 1, 1, 1):
                q, k, v = (torch.randn(h, T, 64, generator=g) for h in (9, 3, 3))
                out = c.update_attend(0, pos, q, k, v)
                pos += T
                if T == 1:
                    outs.append(out.flatten().tolist())
    print(json.dumps({"layer": numba.threading_layer(), "threads": torch.get_num_threads(),
                      "numba": numba.get_num_threads(), "parallel": cpu_kernels.parallel(), "outs": outs}))
""")


def _run(threads: int, **env: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS")}
    e.update(OMP_NUM_THREADS=str(threads), **env)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_torch
def test_numba_kernels_leave_torch_threads_alone():
    from tolerances import fp32_matmul_tol

    first = _run(2)  # compiles the two-thread kernels where numba's disk cache lacks them
    wq = _run(2, NUMBA_THREADING_LAYER="workqueue")
    assert (wq["layer"], wq["threads"], wq["numba"]) == ("workqueue", 2, 2)
    # a parallel kernel compiled in the process and the same kernel loaded from the disk cache have differed in the
    # last bits at two threads (8e-7 here): the pools are compared on cached kernels, the first run within rounding
    ours = _run(2)
    assert ours["layer"] in ("omp", "workqueue") and (ours["threads"], ours["numba"], ours["parallel"]) == (2, 2, True)
    assert ours["outs"] == wq["outs"]  # decode rows: the same bits on either pool
    one = _run(1)
    assert (one["threads"], one["numba"], one["parallel"]) == (1, 1, False)
    for other in (first, one):
        for a, b in zip(other["outs"], ours["outs"], strict=True):
            mag = max(abs(x) for x in b)
            # 603 rows summed in other orders (softmax denominator, value sums, the merge of the splits)
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= fp32_matmul_tol(603, mag, 3)
