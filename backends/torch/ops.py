"""The sampler's array-ops shim over torch (logits stay on the device)."""

from __future__ import annotations

import torch

from swiftlm.sampling import SamplerState

_DT = {"int32": torch.long, "float32": torch.float32}


class TorchOps:
    def __init__(self, device: torch.device):
        self.device = device

    def asarray(self, values, dtype):
        return torch.tensor(values, dtype=_DT[dtype], device=self.device)

    def float32(self, x):
        return x.float().clone()

    def log_softmax(self, x):
        return torch.log_softmax(x, dim=-1)

    def exp(self, x):
        return torch.exp(x)

    def argmax(self, x):
        return int(torch.argmax(x))

    def argsort_desc(self, x):
        return torch.argsort(x, descending=True, stable=True)

    def take(self, x, idx):
        return x[idx]

    def put(self, x, idx, values):
        x = x.clone()
        x[idx] = values
        return x

    def cumsum(self, x):
        return torch.cumsum(x, dim=-1)

    def where(self, cond, a, b):
        a = a if torch.is_tensor(a) else torch.tensor(a, device=self.device)
        b = b if torch.is_tensor(b) else torch.tensor(b, device=self.device)
        return torch.where(cond, a, b).float()

    def kth_largest(self, x, k):
        k = min(k, x.shape[-1])
        return torch.topk(x, k).values[-1]

    def from_numpy(self, a):
        return torch.from_numpy(a).to(self.device)

    def max(self, x):
        return torch.max(x)

    def item(self, x):
        return float(x)

    def tolist(self, x):
        return x.tolist()

    def categorical(self, logits, state: SamplerState):
        if state.rng is None:
            state.rng = torch.Generator(device=self.device)
            state.rng.manual_seed(state.seed)
        probs = torch.softmax(logits.float(), dim=-1)
        return int(torch.multinomial(probs, 1, generator=state.rng))
