"""Test-time compute (swiftlm.test_time): answer extraction, voting, ranking and refinement exactly on
fixed candidates; on the bundled model through LLM and the server, each chain of a batched
self-consistency / best-of-N run equals the same request run alone (seeded), and the votes and scores
are those of the chains."""

import math

import pytest
from conftest import HAS_TORCH

from swiftlm import test_time as tt
from swiftlm.errors import InvalidRequest
from swiftlm.sampling import SamplingParams


def test_extract_answer_modes():
    assert tt.extract_answer("so 12 + 30 = 42.") == "42"
    assert tt.extract_answer("total: 1,250.0 dollars") == "1250"
    assert tt.extract_answer("-3.5 then") == "-3.5"
    assert tt.extract_answer("no digits") is None
    assert tt.extract_answer("work\n\nFinal: Paris \n", "final_line") == "final: paris"
    assert tt.extract_answer("answer is <b>7</b>", "regex", r"<b>(\d+)</b>") == "7"
    assert tt.extract_answer('x {"answer": [1, 2]} y', "json") == "[1, 2]"
    assert tt.extract_answer('{"other": 1}', "json") is None
    with pytest.raises(InvalidRequest):
        tt.extract_answer("1", "nope")


def _cands(spec):  # (text, tokens, logprob)
    return [tt.Candidate(i, t, n, lp) for i, (t, n, lp) in enumerate(spec)]


def test_self_consistency_votes_and_breaks_ties_by_logprob():
    spec = [("it is 4", 3, -1.0), ("maybe 5", 3, -0.5), ("4!", 2, -2.0), ("5", 1, -0.1), ("nothing", 2, -0.2)]
    r = tt.self_consistency(lambda n: _cands(spec[:n]), 5)
    # 4 and 5 both have two votes; 5's chains have the larger total log-probability (-0.6 > -3.0)
    assert r.answer == "5" and r.votes == [("5", 2), ("4", 2)] and r.text == "maybe 5"
    assert r.completion_tokens == 11 and [c.answer for c in r.candidates] == ["4", "5", "4", "5", None]
    r3 = tt.self_consistency(lambda n: _cands(spec[:n]), 3)
    assert r3.answer == "4" and r3.votes == [("4", 2), ("5", 1)]


def test_best_of_n_scores():
    spec = [("a", 10, -5.0), ("b", 2, -2.0), ("c", 4, -3.0)]
    assert tt.best_of_n(lambda n: _cands(spec), 3).text == "a"  # mean: -0.5, -1.0, -0.75
    assert tt.best_of_n(lambda n: _cands(spec), 3, "logprob").text == "b"  # sum
    scores = {"a": 0.2, "b": 0.9, "c": 0.4}
    r = tt.best_of_n(lambda n: _cands(spec), 3, "verifier", verify=scores.__getitem__)
    assert r.text == "b" and [c.score for c in r.candidates] == [0.2, 0.9, 0.4]


def test_refinement_rounds_and_prompts():
    seen = []

    def ask(msgs):
        seen.append([m["content"] for m in msgs])
        return f"reply{len(seen)}", 3

    r = tt.refinement(ask, [{"role": "user", "content": "Q"}], 2, "CRIT", "REV")
    assert r.text == "reply5" and len(r.rounds) == 2 and r.completion_tokens == 15
    assert seen[1] == ["Q", "reply1", "CRIT"] and seen[2] == ["Q", "reply1", "CRIT", "reply2", "REV"]
    assert seen[3] == ["Q", "reply3", "CRIT"]  # the next round critiques the revision


def test_yes_probability_and_request_checks():
    assert tt.yes_probability([(1, " Yes", math.log(0.6)), (2, "No", math.log(0.2))]) == pytest.approx(0.75)
    assert tt.yes_probability([(1, "maybe", -0.1)]) == 0.5
    assert tt.check_request({"strategy": "self_consistency", "answer": "number"})["answer"] == "last_number"
    for bad, param in (
        ({"strategy": "x"}, "test_time.strategy"),
        ({"strategy": "best_of_n", "n": 0}, "test_time.n"),
        ({"strategy": "best_of_n", "n": True}, "test_time.n"),
        ({"strategy": "self_consistency", "answer": "regex"}, "test_time.pattern"),
        ({"strategy": "self_consistency", "answer": "regex", "pattern": "("}, "test_time.pattern"),
        ({"strategy": "refinement", "rounds": 99}, "test_time.rounds"),
        ({"strategy": "best_of_n", "extra": 1}, "test_time"),
        ("x", "test_time"),
    ):
        with pytest.raises(InvalidRequest) as e:
            tt.check_request(bad)
        assert e.value.param == param, bad


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed on this machine")
Q = "What is 17 + 25? Answer with a number."


@needs_torch
def test_chains_equal_solo_runs_on_the_bundled_model(torch_llm):
    p = SamplingParams(temperature=0.9, max_tokens=16, seed=11)
    r = torch_llm.generate_with_self_consistency(Q, n=4, params=p)
    msgs = [{"role": "user", "content": Q}]
    for i, c in enumerate(r.candidates):
        solo = torch_llm.generate(msgs, p.for_choice(i)).outputs[0]
        assert c.text == solo.text and c.tokens == len(solo.token_ids)
    assert sum(n for _, n in r.votes) == sum(c.answer is not None for c in r.candidates)
    assert r.answer == (r.votes[0][0] if r.votes else None)
    b = torch_llm.generate_best_of_n(Q, n=4, params=p)
    assert [c.text for c in b.candidates] == [c.text for c in r.candidates]  # same seeds, same chains
    assert b.text == max(b.candidates, key=lambda c: (c.mean_logprob, -c.index)).text
    lp = SamplingParams(temperature=0.9, max_tokens=16, seed=11, logprobs=True)
    solo = torch_llm.generate(msgs, lp).outputs[0]
    assert b.candidates[0].logprob == pytest.approx(sum(x.logprob for x in solo.logprobs), abs=1e-4)


@needs_torch
def test_server_extension(tiny_llama):
    from starlette.testclient import TestClient

    from swiftlm import LLM
    from swiftlm.server.app import create_app

    llm = LLM(str(tiny_llama), backend="torch", parallel=4, max_tokens=8)
    app = create_app(llm.settings, engine=llm.engine, spec=llm.spec, backend="torch")
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            body = {
                "model": "x",
                "messages": [{"role": "user", "content": Q}],
                "temperature": 0.8,
                "seed": 3,
                "max_tokens": 8,
            }
            r = client.post(
                "/v1/chat/completions",
                json={**body, "test_time": {"strategy": "self_consistency", "n": 5, "answer": "final_line"}},
            )
            assert r.status_code == 200, r.text
            d = r.json()
            tt_out = d["test_time"]
            assert len(tt_out["candidates"]) == 5 and d["usage"]["completion_tokens"] == sum(
                c["tokens"] for c in tt_out["candidates"]
            )
            assert sum(v["count"] for v in tt_out["votes"]) == sum(
                c["answer"] is not None for c in tt_out["candidates"]
            )
            assert d["choices"][0]["message"]["content"] == next(
                c["text"] for c in tt_out["candidates"] if c["answer"] == tt_out["answer"]
            )
            r = client.post("/v1/chat/completions", json={**body, "test_time": {"strategy": "refinement", "rounds": 1}})
            assert r.status_code == 200 and len(r.json()["test_time"]["rounds"]) == 1
            for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n")):
                r = client.post("/v1/chat/completions", json={**body, **extra, "test_time": {"strategy": "best_of_n"}})
                assert r.status_code == 400 and r.json()["error"]["param"] == param
            r = client.post("/v1/chat/completions", json={**body, "test_time": {"strategy": "best_of_n", "n": 999}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "test_time.n"
    finally:
        llm.close()


@needs_torch
def test_cli_flags():
    from conftest import run_cli

    r = run_cli(
        "generate",
        "--backend",
        "torch",
        "-p",
        Q,
        "--self-consistency",
        "3",
        "--temp",
        "0.8",
        "--seed",
        "1",
        "--max-tokens",
        "12",
    )
    assert r.returncode == 0, r.stderr
    assert "[self_consistency: 3 chain(s), 0 round(s)" in r.stderr and r.stdout.strip()
    r = run_cli("generate", "--backend", "torch", "-p", Q, "--self-consistency", "2", "--best-of-n", "2")
    assert r.returncode == 2 and "choose one of" in r.stderr
