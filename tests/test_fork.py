"""``n`` / ``best_of``: one prefill per request, the prompt's KV forked into every choice.

- Engine: n=8 on a ~170-token prompt (two prefill chunks: the module's engine runs with ``prefill_size=128``)
  prefills the prompt once (counted by ``fork_stats``), its KV is shared (``kv_stats`` bytes vs 8 separate requests:
  7 prompts' worth less, from the arithmetic), and greedy choices equal each other and a single greedy request token
  for token.  Seeded choices equal separate requests with the per-choice seeds.  Cancelling the leader before its
  prompt ran hands the group on; cancelling one choice leaves the others.  The same through the engine process,
  and on MLX (where the KV is copied into each fork, not shared).
- Server (the real app): best_of ranks its candidates, the validation errors, and streamed n > 1
  keeps each choice's index and finish_reason (completions and chat).
"""

from __future__ import annotations

import json
import queue
import time

import pytest
from conftest import needs_mlx, needs_torch

from swiftlm import SamplingParams

TEXT = (
    "The lighthouse keeper counted the ships that passed each night, writing their names in a "
    "leather book. Some were fishing boats returning with silver catches, others were tall cargo "
    "vessels bound for distant ports. "
)


def _prompt(engine, tokens: int = 1000) -> list[int]:
    text, ids = "", []
    while len(ids) < tokens:
        text += TEXT
        ids = engine.text_prompt("Story: " + text + "\nQuestion: what did the keeper write down? Answer:")
    return ids


def _run(engine, submit, timeout: float = 300) -> tuple[dict[int, list[int]], dict[int, str], int]:
    """Submit through ``submit(sink)`` (-> ids); each id's tokens and finish reason, and the largest
    ``kv_stats()`` bytes seen at any event."""
    q: queue.Queue = queue.Queue()
    ids = submit(q.put)
    toks = {i: [] for i in ids}
    reasons: dict[int, str] = {}
    kv_max = 0
    deadline = time.time() + timeout
    while len(reasons) < len(ids):
        ev = q.get(timeout=max(1.0, deadline - time.time()))
        toks[ev.seq_id] += ev.token_ids
        kv_max = max(kv_max, engine.kv_stats()["bytes"])
        if ev.finished:
            reasons[ev.seq_id] = ev.finish_reason
    return {i: toks[i] for i in ids}, reasons, kv_max


# Prompt tokens per sequence per step of the module's engine.  A quarter of the default (512): the n=8 test needs a
# prompt longer than one chunk, and its 8 separate requests prefill that prompt 8 times over, so every prompt token
# it needs costs ten; with 128 the test holds all it held at 512 (two chunks, all 8 running together, the KV
# arithmetic) on a quarter of the tokens.  The other tests' prompts fit one chunk either way.
PREFILL = 128


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("torch")
    from swiftlm import LLM

    m = LLM(backend="torch", device="cpu", parallel=8, prompt_cache_bytes=0, prefill_size=PREFILL)
    yield m
    m.close()


@needs_torch
def test_n8_prefills_once_shares_kv_and_greedy_equals_single(llm):
    eng = llm.engine
    prompt = _prompt(eng, 150)  # > prefill_size (128): the group's prompt prefills in two chunks before the fork
    assert PREFILL < len(prompt) <= 2 * PREFILL and eng.scheduler.prefill_size == PREFILL
    # 16 > the <= 11 steps (~128 prompt tokens each: the step's token budget, prefill_size + parallel) that 8
    # separate prompts take to prefill: all 8 overlap
    P, T = len(prompt), 16
    p = SamplingParams(max_tokens=T, temperature=0, ignore_eos=True)
    single = llm.generate(prompt, p).token_ids
    assert len(single) == T

    st = eng.fork_stats
    pre, forked, shared = st.prefill_tokens, st.forked, st.shared
    outs, reasons, kv_forked = _run(
        eng, lambda sink: eng.submit_group(prompt, [p.for_choice(i) for i in range(8)], sink)
    )
    assert st.prefill_tokens - pre == P  # the prompt ran through the model once
    assert st.forked - forked == 7 and st.shared - shared == 7
    assert set(reasons.values()) == {"length"}
    assert all(o == single for o in outs.values())  # greedy: every choice is the single request

    pre = st.prefill_tokens
    sep, _, kv_separate = _run(eng, lambda sink: [eng.submit(prompt, p.for_choice(i), sink) for i in range(8)])
    assert st.prefill_tokens - pre == 8 * P
    assert all(o == single for o in sep.values())
    bpt = eng.info.kv_bytes_per_token
    # forks hold the prompt once plus their own rows; 8 separate requests hold it 8 times (all 8 run
    # together: parallel=8, and each holds >= P rows from its prefill until it ends)
    assert kv_forked <= (P + 8 * T) * bpt
    assert kv_separate >= 8 * P * bpt
    assert kv_separate - kv_forked >= (7 * P - 8 * T) * bpt


@needs_torch
def test_seeded_choices_equal_separate_requests_with_their_seeds(llm):
    eng = llm.engine
    prompt = eng.text_prompt("Once upon a time, in a quiet village by the sea,")
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    outs, _, _ = _run(eng, lambda sink: eng.submit_group(prompt, [p.for_choice(i) for i in range(4)], sink))
    sep = [llm.generate(prompt, p.for_choice(i)).token_ids for i in range(4)]
    assert list(outs.values()) == sep
    assert len({tuple(o) for o in sep}) > 1  # different seeds, different samples


@needs_torch
def test_cancelling_the_leader_or_one_choice(llm):
    eng = llm.engine
    prompt = eng.text_prompt("The three primary colors are")
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    single = llm.generate(prompt, p).token_ids
    pre = eng.fork_stats.prefill_tokens
    q: queue.Queue = queue.Queue()
    ids = eng.submit_group(prompt, [p.for_choice(i) for i in range(3)], q.put)
    eng.cancel(ids[0])  # before its prompt ran: the next choice prefills for the group
    got: dict[int, list[int]] = {i: [] for i in ids}
    reasons: dict[int, str] = {}
    while len(reasons) < 3:
        ev = q.get(timeout=120)
        got[ev.seq_id] += ev.token_ids
        if ev.finished:
            reasons[ev.seq_id] = ev.finish_reason
    assert reasons[ids[0]] == "cancelled"
    assert reasons[ids[1]] == reasons[ids[2]] == "length"
    assert got[ids[1]] == got[ids[2]] == single
    assert eng.fork_stats.prefill_tokens - pre == len(prompt)

    # 64 tokens: the cancel (after choice 1's third token) lands ~60 steps before the others end
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    q = queue.Queue()
    ids = eng.submit_group(prompt, [long.for_choice(i) for i in range(3)], q.put)
    reasons, n = {}, {i: 0 for i in ids}
    while len(reasons) < 3:
        ev = q.get(timeout=300)
        n[ev.seq_id] += len(ev.token_ids)
        if n[ids[1]] >= 3 and ids[1] not in reasons and ev.seq_id == ids[1]:
            eng.cancel(ids[1])  # one choice goes; the others run to their end
        if ev.finished:
            reasons[ev.seq_id] = ev.finish_reason
    assert reasons[ids[1]] == "cancelled" and reasons[ids[0]] == reasons[ids[2]] == "length"
    assert n[ids[0]] == n[ids[2]] == 64 and n[ids[1]] < 64
    assert eng.live_requests == 0


@needs_torch
def test_forked_cache_paths_are_exact():
    """ForkedCache through the generic path (lone rows: concatenated keys) and the batched one, and
    unsharing on a rollback below the prefix, against plain caches (tiny random model, fp32)."""
    import torch

    from swiftlm.backends.torch.build import finish_load
    from swiftlm.backends.torch.decode_rows import decode_batch
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.model import Transformer
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.backends.torch.shared_kv import ForkedCache, share

    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 97,
        "max_position_embeddings": 256,
    }
    torch.manual_seed(0)
    m = Transformer(Args.from_config(cfg))
    with torch.no_grad():
        for prm in m.parameters():
            prm.normal_(0, 0.2)
    m.init_rope()
    m = finish_load(m, torch.float32)
    a, dev = m.a, torch.device("cpu")
    prompt = torch.randint(0, 97, (70,))
    with torch.inference_mode():
        src = SeqCache(a, torch.float32, dev)
        m(prompt, src, 0)
        plain = [SeqCache(a, torch.float32, dev) for _ in range(3)]
        for c in plain:
            m(prompt, c, 0)
        prefix = share(src)
        forks = [ForkedCache(prefix, a, torch.float32, dev) for _ in range(3)]
        toks = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
        for step in range(3):
            ref = decode_batch(m, plain, [t[step] for t in toks], [70 + step] * 3)
            got = decode_batch(m, forks, [t[step] for t in toks], [70 + step] * 3)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        lone_ref = m(torch.tensor([3]), plain[0], 73)  # generic path: the concatenated keys
        lone = m(torch.tensor([3]), forks[0], 73)
        torch.testing.assert_close(lone, lone_ref, rtol=1e-5, atol=1e-5)
        forks[1].length = 60  # rollback below the prefix: unshared (a plain copy), then recomputed
        plain[1].length = 60
        assert forks[1].prefix is None and forks[1].length == 60
        torch.testing.assert_close(m(prompt[60:], forks[1], 60), m(prompt[60:], plain[1], 60), rtol=1e-5, atol=1e-5)
        assert prefix.k[0].shape[1] == 70  # the shared rows were never written
        k, v = forks[0].rows(74)  # a prompt-cache snapshot of a fork: prefix + own rows, compact
        for layer in range(a.layers):
            torch.testing.assert_close(k[layer], plain[0].k[layer][:, :74])
            torch.testing.assert_close(v[layer], plain[0].v[layer][:, :74])


@needs_torch
def test_through_the_engine_process_with_the_prompt_cache():
    from swiftlm import LLM

    on = LLM(backend="torch", device="cpu", engine_process="on", parallel=4)  # prompt cache on (default)
    try:
        eng = on.engine
        prompt = _prompt(eng, 60)  # longer than the prompt cache's shortest match
        p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        single = on.generate(prompt, p).token_ids
        for _ in range(2):  # the second group's leader starts from the prompt cache (the forks' own snapshots)
            outs, reasons, _ = _run(
                eng, lambda sink: eng.submit_group(prompt, [p.for_choice(i) for i in range(4)], sink)
            )
            assert all(o == single for o in outs.values()) and set(reasons.values()) == {"length"}
        time.sleep(0.3)  # the stats snapshot rides with the last step's message
        assert eng.fork_stats.forked == 6 and eng.fork_stats.shared == 6
        assert eng.fork_stats.prefill_tokens < 3 * len(prompt)  # the single request, two groups, cache hits
    finally:
        on.close()


@needs_torch
def test_more_choices_than_running_slots():
    """parallel=1: the choices run one after another, each from the shared prompt KV."""
    from swiftlm import LLM

    one = LLM(backend="torch", device="cpu", parallel=1, prompt_cache_bytes=0)
    try:
        eng = one.engine
        prompt = eng.text_prompt("The capital of France is")
        p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        single = one.generate(prompt, p).token_ids
        pre = eng.fork_stats.prefill_tokens
        outs, _, _ = _run(eng, lambda sink: eng.submit_group(prompt, [p.for_choice(i) for i in range(3)], sink))
        assert all(o == single for o in outs.values())
        assert eng.fork_stats.prefill_tokens - pre == len(prompt) and eng.fork_stats.forked == 2
    finally:
        one.close()


@needs_mlx
def test_mlx_forks_copy_the_prompt_kv(tiny_llama):
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend="mlx", parallel=4, prompt_cache_bytes=0)
    try:
        eng = llm.engine
        prompt = eng.text_prompt("alpha beta gamma delta epsilon zeta eta theta")
        p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        single = llm.generate(prompt, p).token_ids
        pre = eng.fork_stats.prefill_tokens
        outs, _, _ = _run(eng, lambda sink: eng.submit_group(prompt, [p.for_choice(i) for i in range(3)], sink))
        assert all(o == single for o in outs.values())
        assert eng.fork_stats.prefill_tokens - pre == len(prompt)
        assert eng.fork_stats.forked == 2 and eng.fork_stats.shared == 0  # copied, not shared
    finally:
        llm.close()


# ------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def client(llm):
    from starlette.testclient import TestClient

    from swiftlm.server.app import create_app

    app = create_app(llm.settings, engine=llm.engine, spec=llm.spec, backend="torch")
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@needs_torch
def test_completions_n_is_one_prefill_and_greedy_choices_agree(client, llm):
    st = llm.engine.fork_stats
    pre = st.prefill_tokens
    r = client.post(
        "/v1/completions", json={"prompt": "The capital of France is", "n": 3, "max_tokens": 8, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert [c["index"] for c in d["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in d["choices"]}) == 1
    assert st.prefill_tokens - pre == d["usage"]["prompt_tokens"]


@needs_torch
def test_best_of_returns_the_top_candidates_by_logprob(client):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 5}
    r = client.post("/v1/completions", json={**body, "n": 4, "logprobs": 0})
    assert r.status_code == 200, r.text
    cands = r.json()["choices"]
    cum = [sum(c["logprobs"]["token_logprobs"]) for c in cands]
    mean = [s / len(c["logprobs"]["token_logprobs"]) for s, c in zip(cum, cands)]
    for rank, score in (("cumulative", cum), ("mean", mean)):
        r = client.post("/v1/completions", json={**body, "n": 2, "best_of": 4, "best_of_rank": rank})
        assert r.status_code == 200, r.text
        d = r.json()
        best = sorted(range(4), key=lambda i: -score[i])[:2]
        assert [c["text"] for c in d["choices"]] == [cands[i]["text"] for i in best]
        assert [c["index"] for c in d["choices"]] == [0, 1]
        assert all(c["logprobs"] is None for c in d["choices"])  # ranked on logprobs nobody asked to see
        assert d["usage"]["completion_tokens"] == 4 * 8  # every candidate was generated
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "n": 1,
            "best_of": 3,
            "max_tokens": 6,
            "temperature": 1.0,
            "seed": 1,
        },
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 18


@needs_torch
@pytest.mark.parametrize(
    "extra, why",
    [
        ({"n": 3, "best_of": 2}, "at least 'n'"),
        ({"best_of": 17}, "at most 16"),
        ({"n": 1, "best_of": 2, "stream": True}, "cannot be streamed"),
        ({"best_of": 2, "best_of_rank": "median"}, "best_of_rank"),
    ],
)
def test_best_of_validation(client, extra, why):
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = client.post(path, json={**body, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert why in err["message"] and err["param"] in ("best_of", "best_of_rank")


@needs_torch
def test_streamed_n_keeps_indices_and_finish_reasons(client):
    body = {"prompt": "The three primary colors are", "n": 3, "max_tokens": 8, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200
    text, finish = {}, {}
    for c in _sse(r.text):
        for ch in c["choices"]:
            text[ch["index"]] = text.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"] is not None:
                assert ch["index"] not in finish  # one finish per choice
                finish[ch["index"]] = ch["finish_reason"]
    assert sorted(text) == [0, 1, 2] and finish == {i: full["choices"][i]["finish_reason"] for i in range(3)}
    assert [text[i] for i in range(3)] == [c["text"] for c in full["choices"]]

    chat = {"messages": [{"role": "user", "content": "Name a color."}], "n": 3, "max_tokens": 8, "temperature": 0}
    full = client.post("/v1/chat/completions", json=chat).json()
    r = client.post("/v1/chat/completions", json={**chat, "stream": True})
    content, finish, roles = {}, {}, {}
    for c in _sse(r.text):
        for ch in c["choices"]:
            i = ch["index"]
            roles[i] = roles.get(i, 0) + (ch["delta"].get("role") == "assistant")
            content[i] = content.get(i, "") + (ch["delta"].get("content") or "")
            if ch["finish_reason"] is not None:
                assert i not in finish
                finish[i] = ch["finish_reason"]
    assert roles == {0: 1, 1: 1, 2: 1}
    assert finish == {i: full["choices"][i]["finish_reason"] for i in range(3)}
    assert [content[i] for i in range(3)] == [c["message"]["content"] for c in full["choices"]]


@needs_torch
def test_python_api_n_and_test_time_chains_prefill_once(llm):
    """``LLM.generate`` with n > 1 and the test-time strategies' chains go through the fork group:
    the prompt is prefilled once per call, greedy choices equal a single greedy request, and
    self-consistency's N sampled chains still differ (per-choice seeds)."""
    eng = llm.engine
    prompt = "Question: what is 17 plus 25? Answer:"
    single = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0)).outputs[0].token_ids
    n_prompt = len(eng.text_prompt(prompt))
    before = eng.fork_stats.prefill_tokens
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, n=4))
    assert eng.fork_stats.prefill_tokens - before == n_prompt
    assert [o.token_ids for o in out.outputs] == [single] * 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    deltas = []
    for n in (1, 4):
        before = eng.fork_stats.prefill_tokens
        res = llm.generate_with_self_consistency(prompt, n=n, params=sampled)
        deltas.append(eng.fork_stats.prefill_tokens - before)
    assert deltas[0] > n_prompt and deltas[1] == deltas[0]  # the chat prompt of four chains prefilled once
    assert len(res.candidates) == 4 and len({c.text for c in res.candidates}) > 1
