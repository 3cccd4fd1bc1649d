"""Sliding-window layers keep bounded KV memory on the per-sequence cache path (kv_cache.SeqCache: CPU, and
CUDA's eager path): a window layer drops the rows no query can see any more, so its rows stay at about
``window + chunk + a block`` while a full-attention layer's grow with the sequence.

Tiny random checkpoints (fp32, windows of 8 / 16) generate 200+ tokens past the window through the engine
(batched prompts of different lengths, prefill chunks of 10).  Checked: the greedy tokens equal those of the
same model keeping every row (``SWIFTLM_WINDOW_KV_TRIM=0``, the switch kept for this test) and transformers'
greedy generate; the window layers' bytes stay bounded; prompt-cache reuse and ngram speculative decoding
give the plain greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_ckpt, needs_torch
from test_torch_config_fields import write_hf as write_hf_config_fields

pytestmark = [needs_torch]

BASE = [1, 17, 300, 4021, 77, 901, 12, 5, 6000, 33, 2048, 700, 18, 19, 4000, 8, 9, 10, 11, 1200, 3, 50, 51, 52]
PROMPT = BASE + BASE[:12]  # 36 tokens: past every window here
PROMPTS = [PROMPT, PROMPT[:11], PROMPT[3:25]]  # the short one crosses its window while decoding
N_TOKENS = 210
CHUNK = 10  # prefill chunk (chunked prefill past the window)
GROW = 64  # kv_cache.GROW_ROWS
SHAPE = [
    "--hidden",
    "64",
    "--layers",
    "4",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--intermediate",
    "128",
    "--dtype",
    "float32",
    "--ctx",
    "512",
]
MOE = [
    "--hidden",
    "64",
    "--heads",
    "4",
    "--experts",
    "8",
    "--experts-per-token",
    "2",
    "--moe-intermediate",
    "32",
    "--dtype",
    "float32",
    "--ctx",
    "512",
    "--no-tie",
    "--layers",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--sliding-window",
    "8",
    "--yarn",
    "64",
]


def write_hf(tok_dir: Path, out: Path, model_type: str, **extra) -> Path:
    """A random transformers checkpoint of ``model_type`` (3 layers, 512 positions) with the tiny llama's tokenizer."""
    return write_hf_config_fields(
        tok_dir, out, model_type, **{"num_hidden_layers": 3, "max_position_embeddings": 512, **extra}
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("window_kv")
    tok = make_ckpt(
        root / "tok",
        "--arch",
        "llama",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "64",
        "--dtype",
        "float32",
    )
    return {
        # every layer windowed (mistral applies sliding_window to all layers)
        "mistral": write_hf(tok, root / "mistral", "mistral", sliding_window=16),
        # a full layer first, then window layers (qwen2: layers >= max_window_layers slide)
        "qwen2": write_hf(tok, root / "qwen2", "qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1),
        # alternating sliding / global layers, soft caps (archs.py)
        "gemma2": make_ckpt(
            root / "gemma2",
            "--arch",
            "gemma2",
            *SHAPE,
            "--sliding-window",
            "8",
            "--attn-softcap",
            "3",
            "--final-softcap",
            "2",
            "--query-pre-attn-scalar",
            "24",
        ),
        # attention sinks, alternating sliding / full layers (archs_moe.py)
        "gpt_oss": make_ckpt(root / "gpt_oss", "--arch", "gpt_oss", *MOE, "--swiglu-limit", "1.5"),
    }


def run_engine(path: Path, prompts: list[list[int]], n: int, trim: bool, monkeypatch, peak: dict | None = None, **kw):
    """Greedy tokens of ``prompts`` through the engine, and each finished sequence's per-layer KV bytes
    (taken when the engine frees it).  ``peak``: filled with each window layer's largest row count
    over every write of the run (prefill chunks and decode steps)."""
    from swiftlm import LLM
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.sampling import SamplingParams

    monkeypatch.setenv("SWIFTLM_WINDOW_KV_TRIM", "1" if trim else "0")
    if peak is not None:
        write = SeqCache._update_window

        def recording_write(self, layer, start, k, v):
            out = write(self, layer, start, k, v)
            peak[layer] = max(peak.get(layer, 0), self._k[layer].shape[1], self._v[layer].shape[1])
            return out

        monkeypatch.setattr(SeqCache, "_update_window", recording_write)
    kw = {"parallel": len(prompts), "prefill_size": CHUNK, "prompt_cache_bytes": 0, **kw}
    llm = LLM(str(path), backend="torch", **kw)
    model = llm.engine.model
    sizes: list[list[int]] = []
    free = model.free

    def recording_free(seq_ids):
        for s in seq_ids:
            c = model.caches.get(s)
            if c is not None and c.length > 0:
                sizes.append(c.layer_nbytes())
        return free(seq_ids)

    model.free = recording_free
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs], sizes, model.module.a
    finally:
        llm.close()


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = m.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def row_bytes(a) -> int:
    return 2 * a.kv_heads * a.head_dim * 4  # K and V, fp32


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gpt_oss"])
def test_window_layers_bounded_and_exact(arch, ckpts, monkeypatch):
    path = ckpts[arch]
    peak: dict[int, int] = {}
    trimmed, sizes, a = run_engine(path, PROMPTS, N_TOKENS, True, monkeypatch, peak=peak)
    monkeypatch.undo()
    kept, full_sizes, _ = run_engine(path, PROMPTS, N_TOKENS, False, monkeypatch)
    assert trimmed == kept, arch  # dropping rows no query sees changes nothing
    assert trimmed[0] == hf_greedy(path, PROMPTS[0], N_TOKENS), arch
    assert any(a.windows) and len(sizes) == len(PROMPTS) == len(full_sizes)
    per_row = row_bytes(a)
    # SeqCache's bound: the window, the chunk, and at most 2.5 blocks of slack, during the whole run
    assert sorted(peak) == [i for i, w in enumerate(a.windows) if w], (arch, peak)
    for layer, rows in peak.items():
        assert rows <= a.window(layer) + CHUNK + 2.5 * GROW, (arch, layer, rows)
    for got, before, prompt in zip(sizes, full_sizes, PROMPTS):
        length = len(prompt) + N_TOKENS - 1  # positions computed (the last token is never fed)
        for layer, (b, b0) in enumerate(zip(got, before)):
            w = a.window(layer)
            if w:  # decoding: the window plus half a block, rounded up to a block
                assert b <= -(-(w + GROW // 2) // GROW) * GROW * per_row, (arch, layer, b // per_row)
                assert b0 >= length * per_row  # without the trim: every position's rows
            else:  # a full-attention layer keeps every position
                assert b == b0 and b >= length * per_row, (arch, layer)


def test_bytes_measured_long_run(ckpts, monkeypatch):
    """One long sequence (a 36-token prompt, 400 new tokens) on qwen2: the KV bytes with and without the trim."""
    path = ckpts["qwen2"]
    (mine,), (got,), a = run_engine(path, [PROMPT], 400, True, monkeypatch)
    (ref,), (before,), _ = run_engine(path, [PROMPT], 400, False, monkeypatch)
    assert mine == ref
    print(
        f"\nqwen2 (window 8, layers {a.windows}): per-layer KV bytes at {len(PROMPT) + 399} positions: "
        f"trimmed {got}, every row kept {before}; total {sum(got)} vs {sum(before)}"
    )
    assert got[0] == before[0]  # the full layer
    assert all(g == GROW * row_bytes(a) for g in got[1:])  # round_up(8 + 32, 64) rows
    assert sum(got) < 0.6 * sum(before)


def test_prompt_cache_reuse(ckpts, monkeypatch):
    """A prompt longer than the window: reused from the prompt cache while its window rows were all still
    held (a short answer), recomputed (the snapshot is refused) once the window layers dropped rows; both give
    the greedy tokens of a cache-less engine."""
    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    monkeypatch.setenv("SWIFTLM_WINDOW_KV_TRIM", "1")
    path = ckpts["gemma2"]
    short, long_ = (
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
    )
    follow = PROMPT + [40, 41, 42, 43, 44]
    with (
        LLM(str(path), backend="torch", parallel=1, prefill_size=CHUNK) as cached,
        LLM(str(path), backend="torch", parallel=1, prefill_size=CHUNK, prompt_cache_bytes=0) as plain,
    ):
        first = cached.generate(PROMPT, short)
        second = cached.generate(follow, long_)
        assert second.usage["cached_tokens"] == len(PROMPT)  # reused: nothing dropped at the snapshot
        assert first.token_ids == plain.generate(PROMPT, short).token_ids
        assert second.token_ids == plain.generate(follow, long_).token_ids
        # the 120-token answer dropped window rows: no snapshot, the next turn prefills in full
        third_prompt = follow + second.token_ids[:-1] + [7, 8]
        third = cached.generate(third_prompt, short)
        assert third.usage["cached_tokens"] < len(follow)
        assert third.token_ids == plain.generate(third_prompt, short).token_ids


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_ngram_speculative_equals_greedy(arch, ckpts, monkeypatch):
    """Speculative verification writes rows ahead and rolls back by position: the trim keeps the rows a
    rollback needs (it never drops rows the last chunk's queries see).  (The random mistral / qwen2 never
    repeat themselves, so ngram drafts nothing there; GPT-OSS's drafts are mostly rejected: rollbacks.)"""
    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    monkeypatch.setenv("SWIFTLM_WINDOW_KV_TRIM", "1")
    path = ckpts[arch]
    p = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    prompt = BASE * 3
    with LLM(str(path), backend="torch", parallel=1, prompt_cache_bytes=0) as plain:
        want = plain.generate(prompt, p).token_ids
    with LLM(str(path), backend="torch", parallel=1, prompt_cache_bytes=0, speculative="ngram") as spec:
        assert spec.generate(prompt, p).token_ids == want
        st = spec.engine.speculator.stats
        assert st.steps > 0 and st.drafted > 0, (arch, st)
        if arch == "gpt_oss":
            assert st.accepted < st.drafted, st  # rejected drafts: rows written ahead, then rolled back


def test_seqcache_rows_by_position(ckpts, monkeypatch):
    """SeqCache alone: a window layer's returned rows are always the positions [start + T - S, start + T) of
    what was written (chunks of varying length, a rollback, a rewrite from 0), while its storage stays bounded;
    a write needing dropped rows and a read of ``k`` by position from outside raise instead of going wrong."""
    import torch

    from swiftlm.backends.torch.kv_cache import SeqCache, WindowRowsDropped
    from swiftlm.backends.torch.model_config import Args

    monkeypatch.setenv("SWIFTLM_WINDOW_KV_TRIM", "1")
    a = Args.from_config(json.loads((ckpts["qwen2"] / "config.json").read_text()))
    assert a.windows == (0, 8, 8)
    c = SeqCache(a, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    ref = torch.randn(a.kv_heads, 400, a.head_dim)
    pos = 0
    steps = [10, 10, 7, 1, 1, 5, 1, 33, 1] + [1, 4] * 60
    for i, T in enumerate(steps):
        if i == 20:  # a rollback of 3 positions (a verify block's rejected drafts)
            pos -= 3
        for layer in range(a.layers):
            keys, values = c.update(layer, pos, ref[:, pos : pos + T], -ref[:, pos : pos + T])
            S = keys.shape[1]
            assert S >= min(pos + T, a.window(layer) + T - 1) if a.window(layer) else S == pos + T
            assert torch.equal(keys, ref[:, pos + T - S : pos + T]) and torch.equal(values, -keys)
            assert c.offset(layer) == pos + T - S
            if a.window(layer):
                assert c._k[layer].shape[1] <= a.window(layer) + T + 2.5 * GROW
        pos += T
    assert c.length == pos and c.trimmed and c.offset(0) == 0 and c.offset(1) > 0
    assert c._k[0].shape[1] >= pos  # the full layer keeps every position
    with pytest.raises(WindowRowsDropped):
        c.k  # noqa: B018 - rows [0, length) by position are gone
    with pytest.raises(WindowRowsDropped):
        c.update(1, pos - 100, ref[:, :1], ref[:, :1])  # needs rows before the kept ones
    # the whole sequence again from position 0 (Phi-3's longrope switch): allowed, the rows start over
    keys, _ = c.update(1, 0, ref[:, :50], ref[:, :50])
    assert torch.equal(keys, ref[:, :50]) and c.offset(1) == 0
