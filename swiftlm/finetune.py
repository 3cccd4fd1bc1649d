"""``swiftlm finetune``: train a LoRA adapter on a JSONL dataset, write it (PEFT format on torch,
mlx-lm format on MLX; ``--adapter NAME=PATH`` serves both), and optionally fuse it into a merged
checkpoint.

The MLX trainer (``finetune_mlx``) is mlx-lm's own: ``linear_to_lora_layers`` over the model,
``mlx_lm.tuner.trainer.train`` with its ``TrainingArgs``, ``iterate_batches``, ``default_loss`` and
``CacheDataset``; the examples are the same token ids the torch trainer gets (``read_dataset``:
prompt rendered with the chat template exactly as the server renders it, the answer as targets), and
the fuse is mlx-lm's (``load(base, adapter_path=...)``, ``LoRALinear.fuse``, ``save``).

The torch trainer is plain autograd over the serving model's own forward (backends/torch/model.py)
with the LoRA terms of backends/torch/lora.py: the base weights are frozen, A and B train (Adam),
the loss is cross-entropy on the answer tokens only (the prompt is context).  The examples are
packed into one forward per step (attention causal within each example, blind across them).

Dataset lines: ``{"messages": [...]}`` (the last message is the assistant's answer and the target;
the rest, rendered with the model's chat template, is the prompt), ``{"prompt": ..., "completion":
...}``, or ``{"text": ...}`` (every token is a target).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Example:
    tokens: list[int]
    first_target: int  # tokens[first_target:] are predicted (loss); earlier ones are context

    def __len__(self) -> int:  # mlx-lm's CacheDataset sorts examples by this
        return len(self.tokens)


@dataclass
class FinetuneResult:
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    adapter_dir: str = ""
    fused_dir: str | None = None


def read_dataset(path: str | Path, tokenizer: Any, max_tokens: int = 2048) -> list[Example]:
    """The JSONL lines as token ids with their target split; a ConfigError in one sentence if bad."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data: no such file {path}")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--data {path} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"--data {path} line {n}: expected a JSON object")
        if isinstance(row.get("messages"), list) and row["messages"]:
            msgs = row["messages"]
            last = msgs[-1]
            if (
                not isinstance(last, dict)
                or last.get("role") != "assistant"
                or not isinstance(last.get("content"), str)
            ):
                raise ConfigError(
                    f"--data {path} line {n}: the last message must be the assistant's (string "
                    "content): it is the training target"
                )
            prompt = tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True)
            full = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
            answer = full[len(prompt) :] if full.startswith(prompt) else last["content"]
            ids_p = tokenizer.encode(prompt, add_special_tokens=True)
            ids = ids_p + tokenizer.encode(answer)
            first = len(ids_p)
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            ids_p = tokenizer.encode(row["prompt"], add_special_tokens=True)
            ids = ids_p + tokenizer.encode(row["completion"])
            first = len(ids_p)
        elif isinstance(row.get("text"), str):
            ids, first = tokenizer.encode(row["text"], add_special_tokens=True), 1
        else:
            raise ConfigError(f"--data {path} line {n}: expected 'messages', 'prompt' + 'completion', or 'text'")
        if len(ids) <= first:
            raise ConfigError(f"--data {path} line {n}: the target is empty")
        out.append(Example(ids[:max_tokens], min(first, max_tokens - 1)))
    if not out:
        raise ConfigError(f"--data {path}: no examples")
    return out


def finetune_torch(
    model: str,
    data: str,
    out: str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    steps: int = 100,
    lr: float = 1e-3,
    batch_size: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    fuse: bool = False,
    seed: int = 0,
    device: str | None = None,
    progress: Any = None,
) -> FinetuneResult:
    """Train a LoRA adapter on ``data`` over ``model`` and write it to ``out`` (PEFT format)."""
    import torch
    import torch.nn.functional as F

    from .backends.torch.lora import LoraSet, merged_state, new_adapter, save_peft
    from .backends.torch.model import PackedAttend
    from .backends.torch.runner import load_model
    from .config import Settings
    from .registry import resolve

    if rank < 1 or alpha <= 0 or steps < 1 or lr <= 0 or batch_size < 1:
        raise ConfigError("--rank, --alpha, --steps, --lr and --batch-size must be positive")
    torch.manual_seed(seed)
    spec = resolve(model, allow_download=False)
    if fuse and spec.format == "gguf":
        raise ConfigError("--fuse needs an HF-format base directory (convert a GGUF first with `swiftlm convert`)")
    settings = Settings(model=model, backend="torch", **({"device": device} if device else {}))
    tm = load_model(spec, settings)
    module, dev = tm.module, tm.device
    for p in module.parameters():
        p.requires_grad_(False)
    examples = read_dataset(data, tm.tokenizer, max_tokens=tm.info.context_length)
    ad = new_adapter(module, "train", rank, alpha, list(targets), seed=seed)
    ad.mods = {
        k: (A.detach().to(dev).requires_grad_(True), B.detach().to(dev).requires_grad_(True))
        for k, (A, B) in ad.mods.items()
    }
    lset = LoraSet(module)
    lset.adapters.append(ad)
    lset.names[ad.name] = 1
    params = [t for pair in ad.mods.values() for t in pair]
    opt = torch.optim.Adam(params, lr=lr)
    head = module.embed_tokens.weight if module.lm_head is None else module.lm_head.weight
    res = FinetuneResult(adapter_dir=str(out))
    t0 = time.perf_counter()
    order = list(range(len(examples)))
    g = torch.Generator().manual_seed(seed)
    at = len(order)
    for step in range(steps):
        batch = []
        while len(batch) < min(batch_size, len(examples)):
            if at >= len(order):
                order = torch.randperm(len(examples), generator=g).tolist()
                at = 0
            batch.append(examples[order[at]])
            at += 1
        ids = torch.tensor([t for e in batch for t in e.tokens], dtype=torch.long, device=dev)
        labels, off = torch.full_like(ids, -100), 0
        for e in batch:
            n = len(e.tokens)
            # position i predicts token i + 1: the targets are tokens[first_target:]
            labels[off + e.first_target - 1 : off + n - 1] = ids[off + e.first_target : off + n]
            off += n
        with lset.rows(single=1):
            h = module.hidden(ids, PackedAttend([len(e.tokens) for e in batch], dev), 0)
        logits = F.linear(h, head).float()
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        res.losses.append(float(loss.detach()))
        res.tokens += int((labels != -100).sum())
        if progress is not None:
            progress(step + 1, res.losses[-1])
    res.seconds = round(time.perf_counter() - t0, 3)
    save_peft(ad, out, alpha, str(model))
    if fuse:
        res.fused_dir = str(Path(out) / "fused")
        write_fused(spec, ad, Path(res.fused_dir), merged_state)
    return res


def write_fused(spec: Any, ad: Any, out: Path, merged_state: Any) -> None:
    """The base checkpoint's files with the adapter folded into the weights (one safetensors file)."""
    from safetensors.torch import save_file

    from .backends.torch.loader import load_state

    out.mkdir(parents=True, exist_ok=True)
    src = Path(spec.path)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    _, state = load_state(spec)
    state = merged_state(state, ad)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))


class _MlxExamples:
    """``read_dataset``'s examples in the shape mlx-lm's trainer reads (CacheDataset around an
    object with ``__getitem__``, ``__len__`` and ``process`` -> (tokens, offset of the targets))."""

    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def __len__(self) -> int:
        return len(self.examples)

    @staticmethod
    def process(e: Example) -> tuple[list[int], int]:
        return e.tokens, e.first_target


def finetune_mlx(
    model: str,
    data: str,
    out: str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    steps: int = 100,
    lr: float = 1e-3,
    batch_size: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    fuse: bool = False,
    seed: int = 0,
    progress: Any = None,
) -> FinetuneResult:
    """Train a LoRA adapter with mlx-lm's trainer and write it to ``out`` in mlx-lm's format
    (adapters.safetensors + adapter_config.json); ``fuse``: also OUT/fused through mlx-lm's fuse."""
    import contextlib
    import sys

    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from .backends.mlx.loader import load_gguf, load_hf
    from .registry import resolve

    if rank < 1 or alpha <= 0 or steps < 1 or lr <= 0 or batch_size < 1:
        raise ConfigError("--rank, --alpha, --steps, --lr and --batch-size must be positive")
    spec = resolve(model, allow_download=False)
    if fuse and spec.format == "gguf":
        raise ConfigError("--fuse needs an HF-format base directory (convert a GGUF first with `swiftlm convert`)")
    mx.random.seed(seed)
    np.random.seed(seed)  # iterate_batches shuffles with numpy's global generator
    if spec.format == "gguf":
        module, tokenizer, config = load_gguf(spec)
    else:
        module, tokenizer, config, _ = load_hf(spec)
    ctx = int(spec.context_length or config.get("max_position_embeddings") or 4096)
    examples = read_dataset(data, tokenizer, max_tokens=ctx)
    layers = list(module.layers)
    keys = sorted(k for k, m in layers[0].named_modules() if k.rpartition(".")[2] in targets)
    missing = sorted(set(targets) - {k.rpartition(".")[2] for k in keys})
    if missing:
        raise ConfigError(
            f"--targets: {missing[0]!r} is not a projection of this model's layers "
            f"({', '.join(sorted({k.rpartition('.')[2] for k, _ in layers[0].named_modules() if k}))})"
        )
    lora_parameters = {"rank": rank, "scale": alpha / rank, "dropout": 0.0, "keys": keys}
    module.freeze()
    linear_to_lora_layers(module, len(layers), lora_parameters)
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    res = FinetuneResult(adapter_dir=str(outp))

    class _Losses(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            res.losses.append(float(info["train_loss"]))
            res.tokens = int(info["trained_tokens"])
            if progress is not None:
                with contextlib.redirect_stdout(stdout):  # our progress lines stay on stdout
                    progress(int(info["iteration"]), res.losses[-1])

    bs = min(batch_size, len(examples))
    args = TrainingArgs(
        batch_size=bs,
        iters=steps,
        steps_per_report=1,
        steps_per_eval=steps + 1,
        steps_per_save=steps + 1,
        max_seq_length=ctx,
        adapter_file=str(outp / "adapters.safetensors"),
    )
    t0 = time.perf_counter()
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm's progress table: stdout stays ours
        train(
            module,
            optim.Adam(learning_rate=lr),
            CacheDataset(_MlxExamples(examples)),
            None,
            args=args,
            training_callback=_Losses(),
        )
    res.seconds = round(time.perf_counter() - t0, 3)
    (outp / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": len(layers),
                "lora_parameters": lora_parameters,
                "model": str(model),
                "data": str(data),
                "iters": steps,
                "batch_size": bs,
                "learning_rate": lr,
                "seed": seed,
                "trainer": "mlx_lm.tuner.trainer.train (swiftlm finetune --backend mlx)",
            },
            indent=2,
        )
    )
    if fuse:
        res.fused_dir = str(outp / "fused")
        fuse_mlx(spec.path, outp, Path(res.fused_dir))
    return res


def fuse_mlx(base: str | Path, adapter: str | Path, out: Path) -> None:
    """mlx-lm's fuse (mlx_lm/fuse.py): the base loaded with the adapter, each LoRA layer folded into
    its linear (``W + scale * B^T A^T``), saved as an HF-format checkpoint in the base's dtype."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load, save

    model, tokenizer, config = load(str(base), adapter_path=str(adapter), return_config=True)
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    save(out, str(base), model, tokenizer, config, donate_model=False)
