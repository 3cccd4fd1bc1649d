"""The sampler's array-ops shim over mlx.core (logits stay on the device)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_DT = {"int32": mx.int32, "float32": mx.float32}


class MLXOps:
    def asarray(self, values, dtype):
        return mx.array(values, dtype=_DT[dtype])

    def float32(self, x):
        return x.astype(mx.float32)

    def log_softmax(self, x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def exp(self, x):
        return mx.exp(x)

    def argmax(self, x):
        return int(mx.argmax(x).item())

    def argsort_desc(self, x):
        return mx.argsort(-x)

    def take(self, x, idx):
        return x[idx]

    def put(self, x, idx, values):
        x = mx.array(x)
        x[idx] = values
        return x

    def cumsum(self, x):
        return mx.cumsum(x)

    def where(self, cond, a, b):
        return mx.where(cond, a, b).astype(mx.float32)

    def kth_largest(self, x, k):
        k = min(k, x.shape[-1])
        return mx.min(mx.topk(x, k))

    def from_numpy(self, a):
        return mx.array(a)

    def max(self, x):
        return mx.max(x)

    def item(self, x):
        return float(x.item())

    def tolist(self, x):
        return x.tolist()

    # ---- batched ops (swiftlm.sampler.BatchOps) on [rows, V] arrays
    def f32(self, x):
        return x.astype(mx.float32)

    def as_f32(self, x):
        return x.astype(mx.float32)

    def vec(self, a):
        a = np.ascontiguousarray(a)
        return mx.array(a.astype(np.int32) if a.dtype == np.int64 else a)

    def gather2(self, x, r, c):
        return x[r, c]

    def scatter2(self, x, r, c, v):
        x = mx.array(x)
        x[r, c] = v
        return x

    def log_softmax_rows(self, x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def softmax_rows(self, x):
        return mx.softmax(x, axis=-1, precise=True)

    def argmax_rows(self, x):
        return mx.argmax(x, axis=-1)

    def sort_desc_rows(self, x):
        idx = mx.argsort(-x, axis=-1)
        return mx.take_along_axis(x, idx, axis=-1), idx

    def take_along(self, x, idx):
        return mx.take_along_axis(x, idx, axis=-1)

    def put_along(self, x, idx, v):
        return mx.put_along_axis(x, idx, v, axis=-1)

    def cumsum_rows(self, x):
        return mx.cumsum(x, axis=-1)

    def topk_rows(self, x, k):
        idx = mx.argsort(-x, axis=-1)[:, :k]
        return mx.take_along_axis(x, idx, axis=-1), idx

    def max_rows(self, x):
        return mx.max(x, axis=-1, keepdims=True)

    def count_below(self, c, t):
        return mx.sum(c < t, axis=-1)

    def to_host(self, x):
        return np.array(x)

    def start_copy(self, x):
        # No mx.async_eval here: an evaluation left queued on a stream can abort the process at
        # exit; the copy is made synchronously in wait() instead
        return x

    def wait(self, handle):
        return np.array(handle)

    def pack(self, cols):
        return mx.concatenate([c.astype(mx.float32).reshape(c.shape[0], -1) for c in cols], axis=1)

    def where_int(self, cond, a, b):
        return mx.where(cond, a, b).astype(mx.int32)

    def one_row(self, x):
        return x.reshape(1, -1)

    def end_thread(self) -> None:
        # MLX's streams are per thread and must be destroyed by the thread that made them before
        # the interpreter shuts down, else the process can abort at exit ("terminate called without
        # an active exception"; ml-explore/mlx#3126, and the maintainers' advice in mlx#4110/#4327)
        mx.clear_streams()
