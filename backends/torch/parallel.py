"""Tensor parallelism for the torch backend (``--tensor-parallel N``), Megatron style.

Each rank holds a slice of every layer: attention by heads (the K/V heads of its query heads;
with fewer KV heads than ranks each rank keeps a copy of the one KV head its query heads read),
the MLP column-parallel (gate/up rows) then row-parallel (down columns), the embedding and the LM
head by vocabulary.  Two all-reduces per layer (after ``o_proj`` and after ``down_proj``; in a fused
decode step with two ranks, peer stores summed inside the add + RMSNorm that follows: ``tp_allreduce``)
and one for the embedding; the LM head's vocabulary slices are gathered once per step, outside any CUDA
graph, so that rank 0's sampler sees full logits.  The paged KV cache is sharded by heads for free:
every cache is built from the rank's local ``Args`` (its own head count).

The model code is the single-process one (``model.py``, ``graphs.py``): the sharded layers are
drop-in subclasses of ``nn.Linear`` / ``nn.Embedding`` whose forward ends in the collective, so
eager steps, batched decode and CUDA-graph capture all run them (NCCL collectives are captured in
the graphs).  Which rank runs what is the core's business (``swiftlm.distributed``): every rank
executes the same ``Model`` calls in the same order.

Loading: each rank reads only its slices from safetensors (``safe_open(...).get_slice``).  A GGUF
file is dequantized tensor by tensor and each rank keeps its slices of each (one full tensor at a
time in memory, but every rank dequantizes the whole file).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from swiftlm.backend import Forward, StepBatch
from swiftlm.errors import ConfigError
from swiftlm.registry import ModelSpec

from .archs_config import refuse_flag
from .build import build, tokenizer_and_info
from .devices import _apply_mem_limit, pick_device
from .loader import Cut, check_arch, checkpoint_config, read_tensors
from .model import Transformer
from .model_config import Args
from .tp_allreduce import all_reduce
from .tp_allreduce import setup as setup_all_reduce

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the split
@dataclass(frozen=True)
class Plan:
    """What rank ``rank`` of ``world`` holds: query heads [q0, q1), KV heads [kv0, kv1), MLP
    columns [i0, i1), vocabulary rows [v0, v0 + vocab_rows) (the last rank's slice is padded with
    zero rows past the real vocabulary, so that every rank's logits have the same width).  A
    ``build.Part``: the policy loader.read_tensors reads the rank's slices with, and its model."""

    rank: int
    world: int
    q0: int
    q1: int
    kv0: int
    kv1: int
    i0: int
    i1: int
    v0: int
    vocab_rows: int
    vocab: int  # the full vocabulary
    head_dim: int

    def pick(self, name: str) -> tuple[str, Cut | None]:
        """Every tensor, under its HF name: this rank's rows / columns of it (``cut``), or all of it."""
        return name, self.cut(name)

    def cut(self, name: str) -> Cut | None:
        """(dim, start, stop) of an HF tensor name this rank keeps a slice of; None: kept whole."""
        D = self.head_dim
        if ".self_attn.q_proj." in name:
            return 0, self.q0 * D, self.q1 * D
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return 0, self.kv0 * D, self.kv1 * D
        if name.endswith(".self_attn.o_proj.weight"):
            return 1, self.q0 * D, self.q1 * D
        if name.endswith(".mlp.gate_proj.weight") or name.endswith(".mlp.up_proj.weight"):
            return 0, self.i0, self.i1
        if name.endswith(".mlp.down_proj.weight"):
            return 1, self.i0, self.i1
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            return 0, self.v0, min(self.v0 + self.vocab_rows, self.vocab)
        return None

    def pad(self, state: dict[str, torch.Tensor]) -> None:
        """The last rank's vocabulary slices (embedding, LM head) padded in place with zero rows to ``vocab_rows``."""
        for name, t in state.items():
            if (name.endswith("embed_tokens.weight") or name == "lm_head.weight") and t.shape[0] < self.vocab_rows:
                state[name] = torch.cat([t, t.new_zeros(self.vocab_rows - t.shape[0], *t.shape[1:])])

    def args(self, a: Args) -> Args:
        q, kv, i = self.q1 - self.q0, self.kv1 - self.kv0, self.i1 - self.i0
        return replace(a, heads=q, kv_heads=kv, intermediate=i, vocab=self.vocab_rows)

    def shape(self, model: Transformer) -> None:
        """The single-process module tree with this rank's head, column and vocabulary counts (``args``), and
        the sharded layers where a collective is needed."""
        la = model.a
        model.embed_tokens = VocabParallelEmbedding(la.vocab, la.hidden, self.v0)
        for blk in model.layers:
            blk.self_attn.o_proj = RowParallelLinear(la.heads * la.head_dim, la.hidden, bias=False)
            blk.mlp.down_proj = RowParallelLinear(la.intermediate, la.hidden, bias=False)
        model.plan = self


def make_plan(c: dict, rank: int, world: int) -> Plan:
    """The split of a model config over ``world`` ranks; ConfigError (one sentence naming
    --tensor-parallel) when the model cannot be split that way."""
    a = Args.from_config(c)
    refuse_flag(a, "--tensor-parallel")
    H, KVH = a.heads, a.kv_heads
    if a.experts:
        raise ConfigError(
            "--tensor-parallel does not support MoE models yet (experts are not sharded); serve this model without it"
        )
    if H % KVH:
        raise ConfigError(f"--tensor-parallel: {H} query heads are not a multiple of {KVH} KV heads")
    rep = H // KVH
    if KVH >= world:  # whole KV groups per rank (as even as the head count allows)
        kv0, kv1 = rank * KVH // world, (rank + 1) * KVH // world
        q0, q1 = kv0 * rep, kv1 * rep
    else:  # fewer KV heads than ranks: split the query heads, replicate the KV head they read
        q0, q1 = rank * H // world, (rank + 1) * H // world
        if q1 <= q0 or q0 // rep != (q1 - 1) // rep:
            raise ConfigError(
                f"--tensor-parallel {world}: the model's {H} query heads over {KVH} KV heads cannot be "
                f"split so that each rank's query heads share one KV head; use a divisor of {H} that "
                f"is a multiple of {KVH}"
            )
        kv0, kv1 = q0 // rep, q0 // rep + 1
    inter = a.intermediate
    if inter < world or H < world:
        raise ConfigError(f"--tensor-parallel {world} is more ranks than the model's {H} heads / {inter} MLP columns")
    rows = -(-a.vocab // world)
    i0, i1 = rank * inter // world, (rank + 1) * inter // world
    return Plan(rank, world, q0, q1, kv0, kv1, i0, i1, rank * rows, rows, a.vocab, a.head_dim)


# ---------------------------------------------------------------------------- the layers
class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each computes a partial
    output, summed by an all-reduce (``o_proj``, ``down_proj``).  No bias (these never have one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight))

    @staticmethod
    def reduce(y: torch.Tensor) -> torch.Tensor:
        # contiguous: NCCL sums in place on the storage, and a strided view (linear_rows.rows_linear's) would sum wrong
        return all_reduce(y.contiguous())


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the embedding; ids outside them give zeros, and an
    all-reduce assembles each id's row from the rank that holds it.  Its weight is also the
    rank's slice of a tied LM head."""

    def __init__(self, rows: int, dim: int, start: int):
        super().__init__(rows, dim)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out)


def gather_vocab(logits: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """[..., vocab_rows] logits of every rank -> [..., vocab] (all ranks take part)."""
    if logits is None:
        return None
    logits = logits.contiguous()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits)
    return torch.cat(parts, dim=-1)[..., :vocab]


# ---------------------------------------------------------------------------- the Model
def sharded_model_class(base: type) -> type:
    """``base`` (runner.TorchModel) with full-vocabulary logits: the ranks' slices are gathered at
    the end of every call that returns logits, and the overlapped decode's on-device input ids
    (rank 0's sampler output) are broadcast to the other ranks first."""

    class ShardedTorchModel(base):  # type: ignore[misc, valid-type]
        def forward(self, batch: StepBatch) -> Forward:
            if batch.input_ids is not None:
                if dist.get_rank() == 0:
                    ids = batch.input_ids.to(device=self.device, dtype=torch.long).contiguous()
                else:  # the leader sent a placeholder holding the row count (swiftlm.distributed.control)
                    ids = torch.empty(int(batch.input_ids.n), dtype=torch.long, device=self.device)
                dist.broadcast(ids, 0)
                batch = StepBatch(batch.seqs, batch.preempted, ids)
            # the base forward computes prefill rows through self.logits: inside it those stay
            # vocabulary slices like the batched decode rows, and the whole [rows, V/world] block is
            # gathered once (gathering some rows early made a step that mixes prefill and decode rows
            # stack slices of two widths)
            self._in_forward = True
            try:
                fwd = super().forward(batch)
            finally:
                self._in_forward = False
            fwd.logits = gather_vocab(fwd.logits, self.module.plan.vocab)
            return fwd

        def logits(self, seq_id: int, tokens: Any, start: int, **kw: Any) -> torch.Tensor:
            out = super().logits(seq_id, tokens, start, **kw)
            return out if getattr(self, "_in_forward", False) else gather_vocab(out, self.module.plan.vocab)

        def score(self, seq_id: int, tokens: list[int], start: int, pad_to: int | None = None) -> torch.Tensor:
            return gather_vocab(super().score(seq_id, tokens, start, pad_to), self.module.plan.vocab)

        def close(self) -> None:
            """Leave the process group (rank 0 after its followers have stopped; a follower on stop),
            so that this process can load another tensor-parallel model later."""
            if dist.is_initialized():
                dist.destroy_process_group()

    return ShardedTorchModel


def _leave_group() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - exiting anyway
        pass


def init_distributed(device_type: str) -> tuple[int, int]:
    """Join the process group of this rank (``swiftlm.distributed.launch.current_rank``): NCCL on
    CUDA, gloo on CPU.  Returns (rank, world)."""
    from swiftlm.distributed.launch import current_rank

    info = current_rank()
    if info is None:
        raise ConfigError("--tensor-parallel: this process was not started as a rank (swiftlm.distributed.launch)")
    if dist.is_initialized():
        raise ConfigError(
            "--tensor-parallel: another tensor-parallel model is loaded in this process; one per "
            "process (close it first)"
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    import atexit

    atexit.register(_leave_group)  # left to interpreter teardown, a group with a dead peer aborts the process
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world,
        timeout=timedelta(seconds=float(os.environ.get("SWIFTLM_TP_TIMEOUT", "600"))),
    )
    return dist.get_rank(), dist.get_world_size()


def join_group(spec: ModelSpec, cfg: Any, stage: bool) -> tuple[Any, torch.device, torch.dtype, int, int, dict]:
    """What a rank of --tensor-parallel (``load_sharded``) or --pipeline-parallel (``stage``: pipeline.load_stage)
    does first: its GPU selected, device and dtype picked (a stage's GPU named by its index), the memory limit
    applied, the host's cores split among the ranks (a stage's: among this host's), the group joined, the
    architecture checked.  Returns (launch.current_rank(), device, dtype, rank, world, the HF config)."""
    from swiftlm.distributed.launch import current_rank

    info = current_rank()
    if torch.cuda.is_available() and info is not None:
        torch.cuda.set_device(info.local_rank)
    device, dtype = pick_device(cfg)
    if stage and device.type == "cuda" and info is not None:
        device = torch.device("cuda", info.local_rank)
    _apply_mem_limit(cfg, device)
    if device.type == "cpu" and info is not None:  # the ranks (of one host, for stages) share its cores
        ranks = max(1, info.local_world or info.world) if stage else info.world
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    rank, world = init_distributed(device.type)
    check_arch(spec)
    return info, device, dtype, rank, world, checkpoint_config(spec)


def load_sharded(spec: ModelSpec, cfg: Any, base: type) -> Any:
    """This rank's model (``runner.load_model`` with --tensor-parallel; ``base``: runner.TorchModel): join
    the group, read this rank's slices (``get_slice`` from safetensors; cut from each dequantized GGUF tensor as
    it is produced), build, wrap."""
    from swiftlm.turboquant.presets import settings_format

    info, device, dtype, rank, world, config = join_group(spec, cfg, stage=False)
    plan = make_plan(config, rank, world)
    state = read_tensors(spec, plan.pick, "--tensor-parallel")
    plan.pad(state)
    module = build(config, state, dtype, device, part=plan)
    del state
    # every rank, same point: peer-store sums (two ranks of one host) or NCCL on CUDA
    setup_all_reduce(device, dtype, one_host=info is None or info.local_world in (0, info.world))
    log.info(
        "tensor-parallel rank %d/%d: query heads [%d, %d), KV heads [%d, %d), MLP columns [%d, %d), "
        "vocabulary rows [%d, %d)",
        rank,
        world,
        plan.q0,
        plan.q1,
        plan.kv0,
        plan.kv1,
        plan.i0,
        plan.i1,
        plan.v0,
        plan.v0 + plan.vocab_rows,
    )
    # weights and KV bytes are this rank's (each rank holds its heads' cache); the vocabulary is the full one
    tokenizer, minfo = tokenizer_and_info(spec, cfg, module, Args.from_config(config), device, dtype)
    slots = max(1, int(getattr(cfg, "parallel", 1) or 1))
    cls = sharded_model_class(base)
    return cls(module, tokenizer, minfo, device, dtype, slots=slots, kv_default=settings_format(cfg))
