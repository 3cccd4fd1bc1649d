"""What the engine process's parent (``engine_process.EngineClient``) shows of the child's engine: its
scheduler levels, prompt cache, model and speculator as the server reads them (/health, /metrics,
start-up facts), rebuilt from the child's ``Ready`` facts and its stats snapshots."""

from __future__ import annotations

import types

from .backend import ModelHooks


class SchedulerView:
    """The child's scheduler levels, as /health and /metrics read them (``len(waiting)`` ...)."""

    def __init__(self, max_running: int, t: tuple = (0, 0, 0, None, 0, None)):
        self.max_running = max_running
        n_wait, n_run, self._kv, self.kv_budget, self.preemptions, self._blocks = t
        self.waiting, self.running = range(n_wait), range(n_run)

    def kv_in_use(self) -> int:
        return self._kv

    def block_stats(self) -> dict[str, int] | None:
        return self._blocks


class PrefixView:
    def __init__(self, t: tuple = (0, 0, 0, 0, 0)):
        self._n, self.bytes, self.hits, self.misses, self.tokens_reused = t

    def __len__(self) -> int:
        return self._n

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Ops:
    def end_thread(self) -> None:
        """Nothing of the device lives in this process."""


class ExpertReaderView:
    def __init__(self, mode: str):
        self.mode, self.stats = mode, None


class LoraView:
    def __init__(self, names: tuple[str, ...]):
        self.names = names


class ModelView(ModelHooks):
    """What the server reads of ``engine.model``: memory figures and start-up facts (the model is
    in the engine process).  Its ModelHooks declare what the child's model supports; the hooks that
    work on KV (snapshot, paged blocks, ...) keep their "not supported" defaults: the engine that
    calls them is in the child."""

    def __init__(self, ready: dict):
        self.ops = Ops()
        self.graph_capture = None
        self._memory: dict = {}
        er = ready.get("expert_reader")
        self.expert_stream = ExpertReaderView(er[0]) if er else None
        self.kv_default = ready.get("kv_default")
        self.can_embed = bool(ready.get("can_embed"))
        names = ready.get("lora_names")
        self.lora = LoraView(tuple(names)) if names is not None else None

    def memory(self) -> dict:
        return dict(self._memory)


class SpeculatorView:
    def __init__(self, drafter: str, k: int):
        self.drafter = types.SimpleNamespace(name=drafter)
        self.k = k
        from .speculative import SpecStats

        self.stats = SpecStats()
