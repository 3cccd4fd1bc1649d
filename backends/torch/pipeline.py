"""Pipeline parallelism for the torch backend (``--pipeline-parallel P``).

The model's layers are split into P contiguous stages, balanced by layer count (stage s holds
layers [s*L//P, (s+1)*L//P)); the first stage also holds the embedding, the last the final norm
and the LM head (and the embedding too when the head is tied to it).  Each rank reads only its
stage's tensors and keeps only its layers' KV caches.

Which rank is which stage: rank 0 (the leader: engine, scheduler, sampler, HTTP) is the *last*
stage, ranks 1..P-1 are stages 0..P-2.  Every rank receives the step's inputs (token ids,
positions) through the control plane (``swiftlm.distributed.control``), so the first stage need
not be rank 0; with the head on rank 0 the logits ([rows, vocab], the largest tensor of a step)
never leave the process that samples them, and only [rows, hidden] activations cross the wire
(torch.distributed send/recv: gloo on CPU, NCCL on CUDA).

A step is a list of *units*, the same on every rank because it is derived from the step's
``StepBatch`` alone: the decode rows split into up to P micro-batches (contiguous, as even as
possible), then each other sequence's chunk (a prompt chunk) as a unit of its own.  Each stage
runs the units in order: receive the unit's activations from the previous stage (the first
stage embeds the tokens), run its layers, send the result on with a non-blocking send, and go
on to the next unit at once; so while stage s+1 works on micro-batch m, stage s already works
on micro-batch m+1.  With P stages and M micro-batches of equal cost a step lasts M + P - 1
micro-batch times, of which each rank is busy M: idle (P - 1) / (M + P - 1) of a step, against
(P - 1) / P without micro-batches (P = M = 2: 1/3 instead of 1/2).  Prompt chunks are units of
their own, so a step with several prompts pipelines them too.

But each micro-batch reads the stage's weights again, and a decode step of a modest batch is
bound by weight reads, not arithmetic: there micro-batching cuts the ranks' idle time yet lowers
throughput, as the extra weight reads cost more than the overlap gains.  So decode rows are split
only when every micro-batch gets at least ``SWIFTLM_PP_MICRO_MIN_ROWS`` rows (default 64, where a
step starts to be bound by arithmetic on a GPU), into
``SWIFTLM_PP_MICROBATCHES`` parts (default P).  Rank 0's values are sent to every rank at load
(every rank must cut a step into the same units).

Exactness: a stage boundary is a copy of an fp32 (or bf16) tensor; no arithmetic changes.  A
step without micro-batches computes bit-for-bit what the single-process model computes.  A
micro-batched decode step runs its matmuls on fewer rows at a time, which may pick a different
GEMM kernel (the same rounding effect the engine's own batching has).

Not here (refused before any process starts, swiftlm.distributed.launch): MoE, compressed KV
caches, speculative decoding, --gpu-layers, embeddings (``hidden_states``).  No CUDA graphs:
stages run eagerly with growing caches.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from swiftlm.backend import Forward, ModelInfo, StepBatch
from swiftlm.errors import ConfigError
from swiftlm.registry import ModelSpec

from .archs_config import refuse_flag
from .attend import CacheAttend
from .build import build, tokenizer_and_info
from .cpu_packed import pack
from .decode_rows import decode_batch
from .devices import bind_thread
from .forward import dense
from .loader import checkpoint_names, read_tensors
from .model import Transformer
from .model_config import Args
from .parallel import join_group

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.")


def stage_layers(layers: int, stage: int, stages: int) -> tuple[int, int]:
    """Layers [l0, l1) of ``stage`` (balanced by count; earlier stages get the smaller share)."""
    return stage * layers // stages, (stage + 1) * layers // stages


def stage_of(rank: int, world: int) -> int:
    """Rank 0 is the last stage; ranks 1..P-1 are stages 0..P-2."""
    return (rank - 1) % world


def rank_of(stage: int, world: int) -> int:
    return (stage + 1) % world


def check_split(config: dict, world: int) -> None:
    """ConfigError (one sentence naming --pipeline-parallel) when the model cannot be split so."""
    a = Args.from_config(config)
    refuse_flag(a, "--pipeline-parallel")
    if a.experts:
        raise ConfigError("--pipeline-parallel does not support MoE models yet; serve this model without it")
    if a.layers < world:
        raise ConfigError(f"--pipeline-parallel {world} is more stages than the model's {a.layers} layers")


@dataclass(frozen=True)
class Stage:
    """Layers [l0, l1) of the model, renumbered from 0; the embedding on the first stage (and on the last when
    its head reads it: ``embed_on_last``), the final norm and the LM head on the last.  A ``build.Part``: the
    policy loader.read_tensors reads only the stage's tensors with, and its model."""

    l0: int
    l1: int
    first: bool
    last: bool
    embed_on_last: bool  # the head is the embedding (tied, or no lm_head.weight in the checkpoint)

    def pick(self, name: str) -> tuple[str, None] | None:
        """This stage's name for an HF tensor (layers renumbered from 0), or None: not this stage's."""
        m = _LAYER.match(name)
        if m:
            i = int(m.group(2))
            keep, name = self.l0 <= i < self.l1, f"{m.group(1) or ''}layers.{i - self.l0}.{name[m.end() :]}"
        elif name.endswith("embed_tokens.weight"):
            keep = self.first or (self.last and self.embed_on_last)
        else:
            keep = self.last and (
                name == "lm_head.weight" or name.endswith("model.norm.weight") or name == "norm.weight"
            )
        return (name, None) if keep else None

    def args(self, a: Args) -> Args:
        """The layer count and the per-layer sliding windows (layer i of the stage is layer l0 + i of the model)."""
        return replace(a, layers=self.l1 - self.l0, windows=tuple(a.windows[self.l0 : self.l1]) if a.windows else ())

    def shape(self, model: Transformer) -> None:
        if not self.first and not (self.last and model.a.tie):
            model.embed_tokens = None
        if not self.last:
            model.norm = None
            model.lm_head = None


def make_stage(spec: ModelSpec, config: dict, stage: int, stages: int) -> Stage:
    """Stage ``stage`` of ``stages`` (``stage_layers``); the last one reads the checkpoint's tensor names (headers
    only) to know whether its head is the embedding."""
    a = Args.from_config(config)
    last = stage == stages - 1
    embed_on_last = last and (a.tie or "lm_head.weight" not in checkpoint_names(spec))
    return Stage(*stage_layers(a.layers, stage, stages), stage == 0, last, embed_on_last)


def units_of(batch: StepBatch, micro: int, min_rows: int = 1) -> tuple[list[list[int]], bool]:
    """The step's units (lists of indices into ``batch.seqs``) and whether decode rows run batched.
    Decode rows (one token, sampled) first, split into up to ``micro`` contiguous micro-batches of
    at least ``min_rows`` rows; then every other sequence alone.  Derived from the batch only:
    every rank gets the same list."""
    decode = [i for i, w in enumerate(batch.seqs) if len(w.tokens) == 1 and w.sample]
    units: list[list[int]] = []
    m = max(1, min(micro, len(decode) // max(1, min_rows)))
    for k in range(m):
        part = decode[k * len(decode) // m : (k + 1) * len(decode) // m]
        if part:
            units.append(part)
    rest = set(decode)
    units += [[i] for i in range(len(batch.seqs)) if i not in rest]
    return units, len(decode) > 1


def micro_settings(stages: int, device: torch.device) -> tuple[int, int]:
    """(micro-batches, least rows per micro-batch): rank 0's environment, sent to every rank."""
    mine = torch.tensor(
        [
            int(os.environ.get("SWIFTLM_PP_MICROBATCHES", "0") or 0) or stages,
            int(os.environ.get("SWIFTLM_PP_MICRO_MIN_ROWS", "64") or 64),
        ],
        dtype=torch.long,
    )
    t = mine.to(device)
    dist.broadcast(t, 0)
    micro, rows = (int(v) for v in t.cpu())
    return max(1, micro), max(1, rows)


def pipeline_model_class(base: type) -> type:
    """``base`` (runner.TorchModel) for one pipeline stage: its KV-cache bookkeeping, prompt-cache
    hooks and memory figures, with a forward that runs this stage's layers and passes activations on."""

    class PipelineTorchModel(base):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            module: Any,
            tokenizer: Any,
            info: ModelInfo,
            device: torch.device,
            dtype: torch.dtype,
            stage: int,
            stages: int,
            kv_default: Any = None,
        ):
            from swiftlm.turboquant.presets import KVFormat

            from .ops import TorchOps

            self.module, self.tokenizer, self.info = module, tokenizer, info
            self.kv_default = kv_default or KVFormat()
            self.kv_formats: dict[int, Any] = {}
            self.device, self.dtype = device, dtype
            self.caches: dict[int, Any] = {}
            self.ops = TorchOps(device)
            self.static = False  # growing caches, eager steps, no overlapped decode (ids go through the control plane)
            self.graphs = None
            self.pool = None
            self.expert_stream = None
            self.overlap = False
            self.graph_capture = {"graphs": 0, "seconds": 0.0, "bytes": 0}
            self.stage, self.stages = stage, stages
            self.first, self.last = stage == 0, stage == stages - 1
            self.prev = rank_of(stage - 1, stages) if not self.first else None
            self.next = rank_of(stage + 1, stages) if not self.last else None
            self.micro, self.micro_min_rows = micro_settings(stages, device)
            # seconds this rank waited for the previous stage's activations inside steps, and spent in steps
            self.pp_stats = {"steps": 0, "micro_batched_steps": 0, "step_seconds": 0.0, "recv_wait_seconds": 0.0}

        # embeddings and speculative verification are not pipelined: declared absent (ModelHooks flags),
        # so the engine says so; the inherited hooks are hidden too
        can_embed = False
        can_score = False

        @property
        def hidden_states(self) -> Any:
            raise AttributeError("hidden_states")

        @property
        def score(self) -> Any:
            raise AttributeError("score")

        @property
        def logits(self) -> Any:
            raise AttributeError("logits")

        def _recv(self, rows: int) -> torch.Tensor:
            x = torch.empty(rows, self.module.a.hidden, dtype=self.dtype, device=self.device)
            t0 = time.perf_counter()
            dist.recv(x, self.prev)
            self.pp_stats["recv_wait_seconds"] += time.perf_counter() - t0
            return x

        def _head(self, x: torch.Tensor) -> torch.Tensor:
            return self.module.head(self.module.norm(x))  # as Transformer.forward: the same kernels, the same bits

        @torch.inference_mode()
        def forward(self, batch: StepBatch) -> Forward:
            bind_thread(self.device)
            t_step = time.perf_counter()
            for w in batch.seqs:
                if w.seq_id not in self.caches:
                    self.kv_formats[w.seq_id] = self.kv_default if w.kv_format is None else w.kv_format
            units, batched = units_of(batch, self.micro, self.micro_min_rows)
            if sum(1 for u in units if len(batch.seqs[u[0]].tokens) == 1 and batch.seqs[u[0]].sample) > 1:
                self.pp_stats["micro_batched_steps"] += 1
            out: dict[int, torch.Tensor] = {}
            sends: list[Any] = []
            m = self.module
            for unit in units:
                seqs = [batch.seqs[i] for i in unit]
                if len(unit) > 1 or (batched and len(seqs[0].tokens) == 1 and seqs[0].sample):
                    # decode rows: the single-process model's batched pass (decode_rows.decode_batch) over this stage
                    caches = [self._cache(w.seq_id, w.start_pos) for w in seqs]
                    positions = [w.start_pos for w in seqs]
                    x = None if self.first else self._recv(len(seqs))
                    toks = [w.tokens[0] for w in seqs] if self.first else None
                    y = decode_batch(m, caches, toks, positions, x=x, head=self.last)
                    if self.last:
                        for j, i in enumerate(unit):
                            out[i] = y[j]
                        continue
                else:
                    (w,) = seqs
                    cache = self._cache(w.seq_id, w.start_pos)
                    if self.first:
                        x = m.embed(torch.tensor(w.tokens, dtype=torch.long, device=self.device))
                    else:
                        x = self._recv(len(w.tokens))
                    pos, m = slice(w.start_pos, w.start_pos + x.shape[0]), self.module
                    y = dense(
                        m, x, m.cos[pos].unsqueeze(1), m.sin[pos].unsqueeze(1), CacheAttend(m.a, cache, w.start_pos)
                    )
                    if self.last:
                        if w.sample:  # as Transformer.forward(last_only=True): norm and head of the last row
                            out[unit[0]] = self._head(y[-1:])[-1]
                        continue
                sends.append(dist.isend(y.contiguous(), self.next))
            for s in sends:
                s.wait()
            self.pp_stats["steps"] += 1
            self.pp_stats["step_seconds"] += time.perf_counter() - t_step
            if not self.last:
                return Forward(None)
            rows = [out[i] for i, w in enumerate(batch.seqs) if w.sample]
            return Forward(torch.stack(rows) if rows else None)

        def close(self) -> None:
            if dist.is_initialized():
                dist.destroy_process_group()

    return PipelineTorchModel


def load_stage(spec: ModelSpec, cfg: Any, base: type) -> Any:
    """This rank's stage (``runner.load_model`` with --pipeline-parallel; ``base``: runner.TorchModel): join
    the group, read this stage's tensors (safetensors: those alone; GGUF: the others dropped as dequantized),
    build, wrap."""
    from swiftlm.turboquant.presets import settings_format

    _, device, dtype, rank, world, config = join_group(spec, cfg, stage=True)
    check_split(config, world)
    stage = stage_of(rank, world)
    st = make_stage(spec, config, stage, world)
    state = read_tensors(spec, st.pick, "--pipeline-parallel")
    module = build(config, state, dtype, device, part=st)
    del state
    if device.type == "cpu":  # the single-process model's oneDNN-packed matrices: its speed and its bits
        pack(module)
    log.info(
        "pipeline-parallel rank %d/%d: stage %d, layers [%d, %d)%s%s",
        rank,
        world,
        stage,
        st.l0,
        st.l1,
        ", embedding" if st.first else "",
        ", norm + LM head" if st.last else "",
    )
    # weights and KV bytes are this stage's
    tokenizer, minfo = tokenizer_and_info(spec, cfg, module, Args.from_config(config), device, dtype)
    cls = pipeline_model_class(base)
    return cls(module, tokenizer, minfo, device, dtype, stage, world, kv_default=settings_format(cfg))
