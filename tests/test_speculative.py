"""Speculative decoding: exact greedy equality with plain decoding, the target's sampling
distribution under rejection sampling, drafts, limits and wiring."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import numpy as np
import pytest
from conftest import BACKENDS, CHAT_PROMPTS, make_ckpt, needs_mlx, needs_torch, run_cli
from server_util import ServerProc

from swiftlm.sampling import SamplingParams
from swiftlm.speculative import NgramDrafter

COPY = (
    "Repeat this paragraph exactly, fixing the one typo: The committee met on Tuesday to review the "
    "budget for the new library. After a long discussion, the members agreed to fund the reading room, "
    "the childrens section and the digital archive."
)


def _llm(model, backend, **kw):
    from swiftlm import LLM

    return LLM(str(model) if model else None, backend=backend, parallel=1, **kw)


def test_ngram_proposals():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    p = SamplingParams()
    toks = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert d.propose(0, toks, 3, p, None)[0] == [8, 9, 1]  # 3-gram 5 6 7 seen before
    assert d.propose(0, toks + [4], 3, p, None)[0] == []  # 7 4 / 4 never seen
    assert d.propose(0, [1, 2, 1, 2, 1, 2], 4, p, None)[0] == [1, 2]  # most recent match, clipped at the end
    assert d.propose(0, [3, 9, 3, 8, 3], 2, p, None)[0] == [8, 3]  # 1-gram fallback, latest occurrence
    assert NgramDrafter().propose(0, [3, 9, 3, 8, 3], 2, p, None)[0] == []  # default: 2-grams at least


def _greedy(llm, prompts, max_tokens):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    return [llm.generate([{"role": "user", "content": q}], sp).token_ids for q in prompts]


SMOLLM2_PROMPTS = [COPY] + CHAT_PROMPTS[:3]


@pytest.fixture(scope="module")
def smollm2_plain(torch_llm):
    """Plain greedy decoding of SMOLLM2_PROMPTS (48 tokens each), once for both modes below: the four prompts as one
    batch (torch_llm runs 4 at a time; batched greedy equals one-at-a-time greedy, tests/test_batching.py), 3 s on
    CPU where one at a time took 6 s."""
    sp = SamplingParams(max_tokens=48, temperature=0)
    return [o.token_ids for o in torch_llm.generate([[{"role": "user", "content": q}] for q in SMOLLM2_PROMPTS], sp)]


@needs_torch
@pytest.mark.parametrize("mode", ["ngram", "self-draft"])
def test_smollm2_greedy_is_identical_torch(smollm2_plain, mode):
    plain = smollm2_plain
    kw = {"speculative": "ngram"} if mode == "ngram" else {"draft_model": "smollm2-135m-instruct"}
    spec = _llm(None, "torch", **kw)
    try:
        assert _greedy(spec, SMOLLM2_PROMPTS, 48) == plain
        st = spec.engine.speculator.stats
        assert st.steps > 0 and st.accepted > 0
        if mode == "self-draft":  # the model as its own draft: every draft is the target's own choice
            assert st.accepted == st.drafted
    finally:
        spec.close()


@needs_mlx
def test_smollm2_greedy_is_identical_mlx(mlx_llm):
    """MLX on a CPU decodes SmolLM2 slowly: one copy prompt, n-gram and self-draft.  The prompt is raw text (16
    tokens) rather than a chat (45: the template's system prompt): MLX's CPU prefill takes ~50 ms a token, and the
    test prefills it four times (plain, n-gram, the draft and its target).  SmolLM2 continues the pattern, so the
    n-gram drafter finds matches (steps > 0) as it did on the chat."""
    prompt = "red green blue, red green blue, red green blue, red green blue,"
    sp = SamplingParams(max_tokens=16, temperature=0)
    plain = mlx_llm.generate(prompt, sp).token_ids
    for kw in ({"speculative": "ngram"}, {"draft_model": "smollm2-135m-instruct"}):
        spec = _llm(None, "mlx", **kw)
        try:
            assert spec.generate(prompt, sp).token_ids == plain, kw
            assert spec.engine.speculator.stats.steps > 0
        finally:
            spec.close()


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """A second random model with the same tokenizer (a different seed): drafts that are
    sometimes right, sometimes wrong."""
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "draft", "--arch", "llama", "--dtype", "float32", "--layers", "1", "--seed", "7"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_synthetic_greedy_is_identical(tiny_llama, tiny_draft, backend):
    prompts = ["a b c d a b c d a b c", "The cat sat on the mat. The cat sat on the", "x"]
    plain_llm = _llm(tiny_llama, backend)
    try:
        plain = _greedy(plain_llm, prompts, 24)
    finally:
        plain_llm.close()
    for kw in ({"speculative": "ngram"}, {"draft_model": str(tiny_draft)}, {"draft_model": str(tiny_llama)}):
        spec = _llm(tiny_llama, backend, num_draft_tokens=3, **kw)
        try:
            assert _greedy(spec, prompts, 24) == plain, kw
            assert spec.engine.speculator.stats.steps > 0
        finally:
            spec.close()


@needs_torch
def test_max_tokens_stop_strings_and_penalties_hold(tiny_llama):
    """Drafts never push a sequence past max_tokens or a stop string; history penalties see the
    accepted tokens in order (greedy with a repetition penalty stays identical)."""
    plain, spec = _llm(tiny_llama, "torch"), _llm(tiny_llama, "torch", speculative="ngram")
    try:
        for sp in (SamplingParams(max_tokens=n, temperature=0) for n in (1, 2, 3, 5, 9)):
            a, b = plain.generate("a b a b a b a b", sp), spec.generate("a b a b a b a b", sp)
            assert a.token_ids == b.token_ids and len(b.token_ids) <= sp.max_tokens
        text = plain.generate("a b a b a b", SamplingParams(max_tokens=16, temperature=0)).text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        sp = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
        assert plain.generate("a b a b a b", sp).text == spec.generate("a b a b a b", sp).text
        sp = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)
        assert plain.generate("a b a b a b", sp).token_ids == spec.generate("a b a b a b", sp).token_ids
    finally:
        plain.close()
        spec.close()


# chi-square critical values at p = 0.001 by degrees of freedom (standard tables)
CHI2_CRIT_P001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    11: 31.264,
    12: 32.909,
}


def _chi2_two_sample(a: Counter, b: Counter, bins: int = 12) -> tuple[float, int]:
    top = [t for t, _ in (a + b).most_common(bins)]
    rows = [
        [a[t] for t in top] + [sum(a.values()) - sum(a[t] for t in top)],
        [b[t] for t in top] + [sum(b.values()) - sum(b[t] for t in top)],
    ]
    obs = np.array(rows, dtype=float)
    obs = obs[:, obs.sum(axis=0) > 0]
    exp = obs.sum(axis=1, keepdims=True) * obs.sum(axis=0, keepdims=True) / obs.sum()
    return float(((obs - exp) ** 2 / exp).sum()), obs.shape[1] - 1


DIST_PROMPT = "a b c d a b c d a b c d a b"
DIST_N = 600


def _dist_params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=1.0, seed=seed)


def _samples(model, n: int = DIST_N, **kw) -> tuple[list[list[int]], object]:
    llm = _llm(model, "torch", num_draft_tokens=3, **kw)
    if kw.get("speculative") == "ngram":
        # 1-gram matches too: on a random model's output, 2-grams rarely repeat, and the test
        # needs drafts (accepted and rejected) at every step to exercise the rule
        llm.engine.speculator.drafter = NgramDrafter(min_ngram=1)
    try:
        got = [llm.generate(DIST_PROMPT, _dist_params(s)).token_ids for s in range(n)]
        return got, (llm.engine.speculator.stats if llm.engine.speculator else None)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def plain_samples(tiny_llama):
    """The plain side's samples, 32 requests at a time: a seeded request draws from its own generator, so these are
    the tokens of one request at a time (all 600 equal, checked when this was written), ~5x sooner.  The speculative
    side stays one at a time (``_samples``): only a lone decode row drafts and verifies."""
    from concurrent.futures import ThreadPoolExecutor

    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="torch", parallel=32)
    try:
        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(lambda s: llm.generate(DIST_PROMPT, _dist_params(s)).token_ids, range(DIST_N)))
    finally:
        llm.close()


@needs_torch
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_sampled_distribution_matches_plain(tiny_llama, tiny_draft, plain_samples, mode):
    """Tokens 2..4 of 600 seeded samples (temperature 1) with and without speculation: a
    two-sample chi-square test over the 12 most frequent tokens + the rest must not reject
    equality at p = 0.001 (seeded, so deterministic).  The same test with the acceptance rule
    broken (every draft kept) fails by orders of magnitude: see test_broken_rule_is_detected."""
    kw = {"speculative": "ngram"} if mode == "ngram" else {"draft_model": str(tiny_draft)}
    spec, st = _samples(tiny_llama, **kw)
    assert st.steps > 0 and 0 < st.accepted < st.drafted  # both branches of the rule ran
    for pos in (1, 2, 3):
        stat, dof = _chi2_two_sample(
            Counter(t[pos] for t in plain_samples if len(t) > pos), Counter(t[pos] for t in spec if len(t) > pos)
        )
        assert stat < CHI2_CRIT_P001[dof], (pos, stat, dof)


@needs_torch
def test_broken_rule_is_detected(tiny_llama, plain_samples, monkeypatch):
    """The chi-square test has teeth: keeping every n-gram draft changes the distribution.  150 broken samples (seeds
    0-149, one at a time like every speculative run) against the 600 plain ones: the third token's statistic is ~730
    against the critical 32.9 (~1150 with 600 samples, when this was written).  A smaller sample only weakens the
    test, so the 600-sample comparison of test_sampled_distribution_matches_plain catches the broken rule too."""
    from swiftlm import speculative

    monkeypatch.setattr(
        speculative.Speculator,
        "_sample",
        staticmethod(
            lambda ops, row, params, state, drafts, qs, i: (drafts[i], True) if i < len(drafts) else (0, False)
        ),
    )
    spec, _ = _samples(tiny_llama, n=150, speculative="ngram")
    stats = [
        _chi2_two_sample(
            Counter(t[pos] for t in plain_samples if len(t) > pos), Counter(t[pos] for t in spec if len(t) > pos)
        )
        for pos in (1, 2, 3)
    ]
    assert any(stat > CHI2_CRIT_P001[dof] for stat, dof in stats)


@needs_torch
def test_wrong_draft_tokenizer_and_missing_draft_are_exit_2(tiny_llama, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different meaning
    (other / "tokenizer.json").write_text(json.dumps(tj))
    r = run_cli("generate", "-p", "hi", "--model", str(tiny_llama), "--backend", "torch", "--draft-model", str(other))
    assert r.returncode == 2 and "different tokenizer" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "-p", "hi", "--model", str(tiny_llama), "--backend", "torch", "--speculative", "draft")
    assert r.returncode == 2 and "needs --draft-model" in r.stderr
    r = run_cli("generate", "-p", "hi", "--model", str(tiny_llama), "--draft-model", str(tmp_path / "nope"))
    assert r.returncode == 2 and "Traceback" not in r.stderr


@needs_torch
def test_server_reports_speculation(tiny_llama):
    s = ServerProc("--model", str(tiny_llama), "--backend", "torch", "--speculative", "ngram")
    try:
        body = {"prompt": "a b c d a b c d a b c d", "max_tokens": 16, "temperature": 0}
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        spec = httpx.get(s.base + "/health").json()["stats"]["speculative"]
        assert spec["drafter"] == "ngram" and spec["verify_steps"] > 0 and spec["drafted"] >= spec["accepted"]
        m = httpx.get(s.base + "/metrics").text
        assert "swiftlm_spec_acceptance_rate" in m and "swiftlm_spec_drafted_tokens" in m
    finally:
        assert s.stop() == 0, s.stderr_tail()
