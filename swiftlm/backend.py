"""The seam between the core and a backend, and entry-point discovery.

The core owns requests, scheduling, sampling parameters and the API; a backend owns
arrays: weights, KV memory, forward passes and kernels.  A backend is a class registered
under the ``swiftlm.backends`` entry-point group; nothing in the core names a backend.

One forward step takes a *batch*: any mix of prefill chunks and decode rows of different
sequences (``StepBatch``).  The first scheduler sends one sequence per step, continuous
batching sends many; the protocol does not change.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

from .errors import BackendUnavailable, SwiftLMError
from .registry import ModelSpec
from .sampling import SamplerState, SamplingParams
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "swiftlm.backends"


@dataclass(frozen=True)
class Availability:
    ok: bool
    device: str = ""
    reason: str = ""  # why not, when ok is False


@dataclass
class ModelInfo:
    arch: str
    num_layers: int
    context_length: int
    vocab_size: int
    num_params: int
    quantization: str
    is_moe: bool = False
    modalities: tuple[str, ...] = ("text",)
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    kv_dtype: str = ""  # what the KV cache stores, in words (e.g. "bfloat16", "fp8 (e4m3, scales: ...)")
    streamed_expert_bytes: int = 0  # expert bytes left on disk (--stream-experts); 0 when all resident
    experts_per_token: int = 0  # in use (after --expert-top-k)
    embedding_only: bool = False  # no LM head (e.g. Qwen3Model): /v1/embeddings only, no generation
    pooling: str = "mean"  # embeddings' pooling (swiftlm.embeddings.pooling_for)


@dataclass
class SeqWork:
    """One sequence's share of a step.

    ``tokens`` are fed at positions ``[start_pos, start_pos + len(tokens))``; the backend
    keeps the KV state of earlier positions from previous steps.  A prefill chunk that is
    not the last one has ``sample=False``; the last chunk and every decode row sample
    one token with the sequence's sampler state.
    """

    seq_id: int
    tokens: list[int]
    start_pos: int
    sample: bool
    params: SamplingParams
    state: SamplerState
    media: Any = None  # media.MediaInputs on a media prompt's (single) prefill chunk
    # the sequence's KV format (turboquant.presets.KVFormat), decided at admission (Sequence.kv_format);
    # None: the model's own default (``kv_default``), e.g. a batch built by hand
    kv_format: Any = None


@dataclass
class StepBatch:
    seqs: list[SeqWork]
    preempted: list[int] = field(default_factory=list)  # sequences whose KV the engine must free first
    # Overlapped decode: the previous step's sampled ids, still on the device ([len(seqs)] ints, row i
    # is seqs[i]'s input token; seqs[i].tokens holds a placeholder).  Only sent to models whose
    # ``overlap`` is True, and only for batches of decode rows.
    input_ids: Any = None


@dataclass
class SampledToken:
    seq_id: int
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Forward:
    """What ``Model.forward`` returns: logits [n, vocab] (backend arrays, possibly still being
    computed on the device) for the batch's rows with ``sample=True`` that did not fail, in
    batch order; sequences that failed (only they end); and the seconds spent preparing inputs
    before the first kernel was queued (the engine's ``prepare`` timer)."""

    logits: Any
    failed: dict[int, str] = field(default_factory=dict)
    prepare_seconds: float = 0.0


@runtime_checkable
class Model(Protocol):
    info: ModelInfo
    tokenizer: Tokenizer

    ops: Any  # the sampler's array ops on this model's device (sampler.BatchOps)
    # True when forward() queues device work and returns before it is done (CUDA, MLX) and accepts
    # ``StepBatch.input_ids``: the engine then launches step k+1 before it reads step k's ids back.
    overlap: bool

    def forward(self, batch: StepBatch) -> Forward:
        """Run one forward pass over the batch (prefill chunks and decode rows) and return the
        logits of the rows that sample.  Sampling is the core's (``sampler.launch``)."""

    def free(self, seq_ids: Sequence[int]) -> None:
        """Drop the KV state of finished or cancelled sequences."""

    def memory(self) -> dict[str, int]:
        """Bytes: active, peak, cache (backend allocator figures)."""

    # The optional hooks (prompt cache, paged KV, embeddings, ...) are ModelHooks, below: every
    # model class inherits their defaults.


# (hook, the capability flag that declares it) -- see ModelHooks
_FLAGGED = {
    "can_snapshot_prefix": ("snapshot_prefix", "restore_prefix"),
    "can_share_prefix": ("share_prefix",),
    "can_embed": ("hidden_states",),
    "can_score": ("score",),
}


class ModelHooks:
    """The optional model hooks, declared once with their defaults.

    Every model class a backend returns inherits this; the core calls a hook or reads an
    attribute directly and never probes for one.  The default of each hook means "not
    supported" (or "nothing to report").  Four hooks the core must know about *before* it
    calls them (whether to keep a prompt cache, fork by sharing blocks, serve embeddings,
    verify drafts) are declared by capability flags.  A subclass that defines the hooks gets
    its flag set to True automatically; a class that sets a flag itself decides it for its
    subclasses too (a pipeline-parallel stage sets ``can_embed = False``: it has no embeddings).

    Forwarding proxies (the tensor-parallel ``Leader``, MLX's ``EvaluatingModel``, the
    replicas' model view) do not inherit it: their ``__getattr__`` forwards every hook to the
    model they wrap, and inherited defaults would shadow it.
    """

    # -- capability flags (set by __init_subclass__ when the hooks are defined)
    can_snapshot_prefix: bool = False  # snapshot_prefix + restore_prefix: the prompt cache, copied forks
    can_share_prefix: bool = False  # share_prefix: forks share the prompt's KV blocks (no copy)
    can_embed: bool = False  # hidden_states: /v1/embeddings
    can_score: bool = False  # score: speculative decoding verifies drafts

    # -- attributes
    kv_default: Any = None  # the served KV format (turboquant.presets.KVFormat); None: plain 16-bit
    lora: Any = None  # a LoRA adapter set (``.names``: the adapters served); None: no adapters
    expert_stream: Any = None  # experts.ExpertReader with --stream-experts; None: experts resident
    graph_capture: dict[str, Any] | None = None  # CUDA graph capture figures; None: no capture
    _declared_flags: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # flags a class of the hierarchy set itself: kept (its subclasses included); the others derived
        declared = {f for c in cls.__mro__[1:] for f in getattr(c, "_declared_flags", ())}
        declared |= {f for f in _FLAGGED if f in cls.__dict__}
        cls._declared_flags = frozenset(declared)
        for flag, hooks in _FLAGGED.items():
            if flag not in declared:
                setattr(cls, flag, all(getattr(cls, h) is not getattr(ModelHooks, h) for h in hooks))

    # -- prompt cache and forks (``can_snapshot_prefix``, ``can_share_prefix``)
    def snapshot_prefix(self, seq_id: int) -> Any:
        """A copy of the sequence's KV rows, to restore into another sequence; None: none taken."""
        return None

    def restore_prefix(self, seq_id: int, payload: Any, n: int) -> None:
        """Make ``payload`` (from snapshot_prefix) the first ``n`` positions of ``seq_id``."""
        raise NotImplementedError("this model keeps no prompt cache (can_snapshot_prefix is False)")

    def share_prefix(self, seq_id: int) -> Any:
        """The sequence's prompt KV for forks to share without a copy; None: not possible now."""
        return None

    # -- a paged KV pool whose blocks the core hands out (kv_blocks.KVBlocks)
    def kv_block_spec(self) -> tuple[int, int] | None:
        """(blocks, block size) of the model's paged KV pool; None: no paged pool."""
        return None

    def attach_kv_blocks(self, blocks: Any) -> None:
        """Called once when kv_block_spec() is not None: the pool's block manager."""
        raise NotImplementedError("kv_block_spec() returned a spec but attach_kv_blocks is not implemented")

    def adopt_prefix(self, seq_id: int, n: int) -> None:
        """The sequence's first ``n`` positions are cached blocks it now holds (paged pool only)."""
        raise NotImplementedError("adopt_prefix needs a paged KV pool (kv_block_spec)")

    def code_page_spec(self) -> tuple[int, int, Any] | None:
        """(blocks, block size, KV format) of TurboQuant codes kept in pages; None: none."""
        return None

    def attach_code_pages(self, blocks: Any) -> None:
        """Called once when code_page_spec() is not None: the code pages' block manager."""
        raise NotImplementedError("code_page_spec() returned a spec but attach_code_pages is not implemented")

    # -- start-up
    def warm_up_waves(self) -> list[list[int]]:
        """Scratch requests the engine runs before serving (warm_up.py), where first use of some path compiles
        kernels or captures CUDA graphs: waves run one after another, each a list of prompt lengths admitted at
        once; [] (the default): none needed."""
        return []

    # -- figures
    def kv_stats(self) -> dict[str, int] | None:
        """{"bytes", "fp16_bytes"} the running sequences' KV holds; None: the engine counts tokens."""
        return None

    def reset_peak_memory(self) -> None:
        """Start memory()["peak"] again from the current figure (`swiftlm bench`); default: nothing."""

    # -- embeddings and verification (``can_embed``, ``can_score``)
    def hidden_states(self, prompts: list[list[int]]) -> list[Any]:
        """Each prompt's final-norm hidden states, [T, hidden] float32 numpy arrays."""
        raise NotImplementedError("this model computes no embeddings (can_embed is False)")

    def score(self, seq_id: int, tokens: list[int], start: int, pad_to: int | None = None) -> Any:
        """Logits of every fed position (speculative verification)."""
        raise NotImplementedError("this model cannot verify drafts (can_score is False)")

    def close(self) -> None:
        """Release what outlives the model object (a process group); default: nothing."""


@runtime_checkable
class Backend(Protocol):
    name: str

    def available(self) -> Availability: ...

    def load(self, spec: ModelSpec, cfg: Any) -> Model: ...


@dataclass
class BackendEntry:
    name: str
    target: str
    backend: Backend | None
    availability: Availability


def discover_backends(names: Iterable[str] | None = None) -> dict[str, BackendEntry]:
    """Load the ``swiftlm.backends`` entry points (all of them, or those in ``names``) and ask
    each for its availability.  A plugin that fails to import or to report availability is
    logged and listed as unavailable, never fatal.  Probing a backend can load its runtime
    (mlx.core and its threads), so callers that know what they want name it."""
    wanted = None if names is None else set(names)
    found: dict[str, BackendEntry] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found or (wanted is not None and ep.name not in wanted):
            continue
        try:
            cls = ep.load()
            backend = cls()
            avail = backend.available()
        except Exception as exc:  # a broken plugin must not take the server down
            log.warning("backend plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)
            found[ep.name] = BackendEntry(
                ep.name,
                ep.value,
                None,
                Availability(False, reason=f"plugin failed to load: {type(exc).__name__}: {exc}"),
            )
            continue
        found[ep.name] = BackendEntry(ep.name, ep.value, backend, avail)
    return found


def preferred_order() -> list[str]:
    """Auto choice: macOS arm64 -> mlx; CUDA -> torch; Linux CPU -> torch, else mlx."""
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return ["mlx", "torch"]
    return ["torch", "mlx"]


def _auto_why(name: str, order: list[str] | None = None) -> str:
    order = order or preferred_order()
    return f"{name} (auto: first available of {', '.join(order)} on {platform.system()} {platform.machine()})"


def choose_backend(requested: str | None, backends: dict[str, BackendEntry] | None = None) -> tuple[Backend, str]:
    """Return (backend, explanation)."""
    if backends is None:
        if requested and requested != "auto":
            # Probe only the requested plugin: probing another can load its runtime into this
            # process (mlx.core's threads in a torch server), which then has to exit cleanly too.
            backends = discover_backends([requested]) or discover_backends()
        else:
            for name in preferred_order():
                found = discover_backends([name])
                if name in found and found[name].availability.ok and found[name].backend is not None:
                    return found[name].backend, _auto_why(name)
            backends = discover_backends()
    if requested and requested != "auto":
        entry = backends.get(requested)
        if entry is None:
            raise BackendUnavailable(
                f"backend {requested!r} is not installed; found: {', '.join(sorted(backends)) or 'none'}"
            )
        if not entry.availability.ok or entry.backend is None:
            raise BackendUnavailable(f"backend {requested!r} is not available: {entry.availability.reason}")
        return entry.backend, f"{requested} (requested with --backend)"
    order = preferred_order() + sorted(n for n in backends if n not in preferred_order())
    for name in order:
        entry = backends.get(name)
        if entry and entry.availability.ok and entry.backend is not None:
            return entry.backend, _auto_why(name, order)
    reasons = "; ".join(f"{n}: {e.availability.reason}" for n, e in backends.items()) or "no backend plugins installed"
    raise BackendUnavailable(f"no usable backend ({reasons}); install one, e.g. pip install 'swiftlm[mlx]'")


__all__ = [
    "Availability",
    "Backend",
    "BackendEntry",
    "Forward",
    "Model",
    "ModelHooks",
    "ModelInfo",
    "SampledToken",
    "SeqWork",
    "StepBatch",
    "SwiftLMError",
    "choose_backend",
    "discover_backends",
]
