"""The sampler's array-ops shim over mlx.core (logits stay on the device)."""

from __future__ import annotations

import mlx.core as mx

from swiftlm.sampling import SamplerState

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

    def categorical(self, logits, state: SamplerState):
        if state.rng is None:
            state.rng = mx.random.key(state.seed & 0xFFFFFFFF)
        state.rng, sub = mx.random.split(state.rng)
        return int(mx.random.categorical(logits, key=sub).item())
