"""A fake backend for the fast test tier: a third-party plugin found through the ``swiftlm.backends`` entry
point (``tests/plugins`` on ``sys.path`` makes its dist-info visible), with no torch or mlx import.

Its model owns a real tokenizer (the bundled GGUF's, or a checkpoint's) and numpy logits that spell out a reply
chosen from the prompt: the key of ``REPLIES`` that occurs last in the decoded prompt selects that reply; otherwise the
model spells ``DEFAULT_REPLY`` over and over (a request ends by max_tokens or a stop string).  A reply ends with
the tokenizer's end-of-sequence token.  The target token gets logit ``PEAK`` and the rest 0, so greedy decoding
reproduces the script exactly and sampling mostly does.  ``hidden_states`` gives deterministic per-token
vectors for the embeddings routes.

Tests use it to exercise the API, the engine and the sampler in-process in milliseconds; anything about real
numerics belongs to the torch and MLX backends' tests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from swiftlm.backend import Availability, Forward, ModelHooks, ModelInfo, StepBatch
from swiftlm.registry import ModelSpec
from swiftlm.sampling import NumpyOps
from swiftlm.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

DEFAULT_REPLY = "The quick brown fox jumps over the lazy dog. "
REPLIES: dict[str, str] = {}
PEAK = 30.0
HIDDEN = 32

# The forward passes seen, for tests that look at batching: (prefill tokens, decode rows) per step.
STEPS: list[tuple[int, int]] = []


class FakeModel(ModelHooks):
    overlap = False

    def __init__(self, spec: ModelSpec):
        if spec.format == "gguf":
            self.tokenizer = load_gguf_tokenizer(spec.gguf_meta or {})
        else:
            self.tokenizer = load_hf_tokenizer(spec.path, spec.config)
        vocab = self.tokenizer.vocab_size
        self.info = ModelInfo(
            arch=spec.arch or "llama",
            num_layers=2,
            context_length=spec.context_length or 8192,
            vocab_size=vocab,
            num_params=0,
            quantization="fake",
            modalities=("text",),
            kv_bytes_per_token=64,
        )
        self.ops = NumpyOps()
        self.eos = self._eos()
        self._seqs: dict[int, list[int]] = {}
        self._scripts: dict[int, tuple[int, list[int]]] = {}  # seq id -> (prompt length, reply tokens)
        self._lock = threading.Lock()
        rng = np.random.default_rng(0)
        self._table = rng.standard_normal((vocab, HIDDEN)).astype(np.float32)

    def _eos(self) -> int:
        ids = sorted(self.tokenizer.eos_token_ids)
        return ids[0] if ids else 0

    def _script(self, prompt: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt)
        found = [(text.rfind(key), key) for key in REPLIES if key in text]
        if found:  # the key that occurs last: the latest turn of a conversation
            return self.tokenizer.encode(REPLIES[max(found)[1]]) + [self.eos]
        return self.tokenizer.encode(DEFAULT_REPLY)

    def _next(self, sid: int) -> int:
        seq = self._seqs[sid]
        if sid not in self._scripts:  # the first sampled row: everything seen so far is the prompt
            self._scripts[sid] = (len(seq), self._script(seq))
        n_prompt, script = self._scripts[sid]
        k = len(seq) - n_prompt
        if script[-1] == self.eos:
            return script[min(k, len(script) - 1)]
        return script[k % len(script)]

    def forward(self, batch: StepBatch) -> Forward:
        sampled = []
        prefill = decode = 0
        with self._lock:
            for sid in batch.preempted:  # recomputed later from its tokens; its script stays
                self._seqs.pop(sid, None)
            for w in batch.seqs:
                seq = self._seqs.setdefault(w.seq_id, [])
                del seq[w.start_pos :]
                seq.extend(w.tokens)
                if w.seq_id in self._scripts and len(w.tokens) == 1:
                    decode += 1
                else:
                    prefill += len(w.tokens)
                if w.sample:
                    sampled.append(w.seq_id)
            STEPS.append((prefill, decode))
            logits = np.zeros((len(sampled), self.info.vocab_size), np.float32)
            for i, sid in enumerate(sampled):
                logits[i, self._next(sid)] = PEAK
        return Forward(logits)

    def free(self, seq_ids: Sequence[int]) -> None:
        with self._lock:
            for sid in seq_ids:
                self._seqs.pop(sid, None)
                self._scripts.pop(sid, None)

    def memory(self) -> dict[str, int]:
        return {"active": 0, "peak": 0, "cache": 0}

    def hidden_states(self, prompts: list[list[int]]) -> list[Any]:
        out = []
        for p in prompts:
            x = self._table[np.asarray(p, np.int64)]
            out.append(np.cumsum(x, axis=0) / (1 + np.arange(len(p), dtype=np.float32))[:, None])
        return out


class FakeBackend:
    name = "fake"

    def available(self) -> Availability:
        return Availability(True, device="cpu (numpy, fake logits)")

    def load(self, spec: ModelSpec, cfg: Any) -> FakeModel:
        return FakeModel(spec)
