"""The two-rank peer-store all-reduce fused into add + RMSNorm (``swiftlm.cuda_ext.peer_sum``), under
TRITON_INTERPRET=1 on CPU tensors: the two ranks are simulated in one process (each rank's buffers are plain
tensors; "the peer's buffer" is the other rank's), both pushes first, then both receives, as two GPUs would
order them.  On the GPU the same kernels are checked against NCCL at load (``tp_allreduce._peer_agrees``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, needs_torch

pytestmark = [
    needs_torch,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
    ),
]

CODE = r"""
import json, torch
from swiftlm.cuda_ext.peer_sum import push, recv_add_rmsnorm
from swiftlm.cuda_ext.decode_kernels import add_rmsnorm
dt = getattr(torch, "{dtype}")
ROWS, CAP = 8, 8 * 1000
ranks = [dict(recv=torch.full((CAP,), 7.0, dtype=dt), full=torch.zeros(ROWS, dtype=torch.int32),
              free=torch.ones(ROWS, dtype=torch.int32)) for _ in range(2)]
g = torch.Generator().manual_seed(5)
res = []
for R, N in [(1, 96), (3, 1000), (8, 200), (2, 33)]:  # one buffer serves every shape, round after round
    # partials on a grid of 1/8 up to 8: their sum is exact in 16-bit floats, so the rounding of the sum
    # cannot differ between the kernel and torch (the interpreter rounds float32 -> 16-bit its own way)
    ys = [(torch.randint(-64, 64, (R, N), generator=g) / 8).to(dt) for _ in range(2)]
    x = torch.randn(R, N, generator=g).to(dt)
    w = torch.randn(N, generator=g).to(dt)
    xs = [x.clone(), x.clone()]
    for r in range(2):
        push(ys[r], ranks[1 - r]["recv"], ranks[1 - r]["full"], ranks[r]["free"])
    after_push = [ranks[r]["full"][:R].tolist() for r in range(2)] + [ranks[r]["free"][:R].tolist() for r in range(2)]
    outs = [recv_add_rmsnorm(xs[r], ys[r], ranks[r]["recv"], ranks[r]["full"], ranks[1 - r]["free"], w, 1e-5)
            for r in range(2)]
    xr = x.clone()
    ref = add_rmsnorm(xr, ys[0] + ys[1], w, 1e-5)  # NCCL's sum (exact here), then the unfused kernel
    res.append(dict(R=R, N=N, after_push=after_push,
                    out_equal=[torch.equal(o, ref) for o in outs], x_equal=[torch.equal(v, xr) for v in xs],
                    full=[ranks[r]["full"].tolist() for r in range(2)],
                    free=[ranks[r]["free"].tolist() for r in range(2)],
                    recv_is_peer=[torch.equal(ranks[r]["recv"][:R * N].view(R, N), ys[1 - r]) for r in range(2)]))
print(json.dumps(res))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_peer_sum_equals_sum_then_add_rmsnorm(dtype):
    import json

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", CODE.format(dtype=dtype)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 4
    for row in rows:
        R = row["R"]
        # after both pushes: each rank's `full` flags raised for the pushed rows, its `free` flags taken
        assert row["after_push"] == [[1] * R, [1] * R, [0] * R, [0] * R], row
        assert row["recv_is_peer"] == [True, True], row
        assert row["out_equal"] == [True, True] and row["x_equal"] == [True, True], row
        # after both receives: every flag back to its resting state, ready for the next call
        assert row["full"] == [[0] * 8, [0] * 8] and row["free"] == [[1] * 8, [1] * 8], row
