"""Test-time compute on the batching engine: self-consistency, best-of-N and refinement.

All N chains of one request are submitted together, so they run as rows of the same decode batch
(the engine batches them like any concurrent requests).  Each strategy is written once over two
callables, so the Python API (``LLM``), the CLI and the server share it:

- ``sample(n) -> list[Candidate]``: N completions of the request's prompt (its sampling parameters,
  seeds ``seed + i`` when seeded), with their token log-probabilities;
- ``ask(messages) -> str``: one completion of a chat (refinement and the verifier use it).

Strategies:
- **self-consistency**: N sampled chains, an answer extracted from each (the last number, a regular
  expression's first group, a JSON field, or the final line), majority vote; ties go to the answer
  whose chains have the higher total log-probability.  The vote table is returned.
- **best-of-N**: N chains ranked by the model's own log-probability (``mean_logprob``, length-normalised,
  the default; or ``logprob``, the sum), or by a verifier prompt on the same model (the probability
  it puts on "Yes" after "Is this answer correct?").
- **refinement**: answer, then ``rounds`` x (critique -> revise) with the prompts below (overridable).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import InvalidRequest

STRATEGIES = ("self_consistency", "best_of_n", "refinement")
ANSWER_MODES = ("last_number", "final_line", "regex", "json")
SCORES = ("mean_logprob", "logprob", "verifier")

CRITIQUE_PROMPT = (
    "Review the answer above for mistakes in reasoning, arithmetic or facts. "
    "List the problems you find briefly; if it is correct, say so."
)
REVISE_PROMPT = "Using the review above, write an improved final answer to the original question. Give only the answer."
VERIFY_PROMPT = (
    "Question:\n{question}\n\nProposed answer:\n{answer}\n\nIs the proposed answer correct? Reply with Yes or No."
)
MAX_N = 64

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class Candidate:
    index: int
    text: str
    tokens: int = 0
    logprob: float = 0.0  # sum over the completion's tokens
    answer: str | None = None
    score: float | None = None

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(self.tokens, 1)


@dataclass
class TestTimeResult:
    strategy: str
    text: str  # the chosen completion (refinement: the last revision)
    answer: str | None = None
    candidates: list[Candidate] = field(default_factory=list)
    votes: list[tuple[str, int]] = field(default_factory=list)  # self-consistency: (answer, chains), most first
    rounds: list[dict] = field(default_factory=list)  # refinement: {"critique", "revision"} per round
    completion_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["votes"] = [{"answer": a, "count": c} for a, c in self.votes]
        for c, cand in zip(d["candidates"], self.candidates):
            c["mean_logprob"] = cand.mean_logprob
        return d


def extract_answer(
    text: str, mode: str = "last_number", pattern: str | None = None, json_field: str | None = None
) -> str | None:
    """The answer a chain gives, normalised for voting (None when it gives none)."""
    if mode == "last_number":
        nums = _NUMBER.findall(text)
        if not nums:
            return None
        v = nums[-1].replace(",", "")
        try:
            f = float(v)
        except ValueError:
            return None
        return str(int(f)) if f.is_integer() else repr(f)
    if mode == "final_line":
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        return lines[-1].lower() if lines else None
    if mode == "regex":
        m = re.search(pattern or "", text)
        if not m:
            return None
        return (m.group(1) if m.groups() else m.group(0)).strip()
    if mode == "json":
        start, end = text.find("{"), text.rfind("}")
        try:
            obj = json.loads(text[start : end + 1]) if start >= 0 else None
        except ValueError:
            return None
        if not isinstance(obj, dict) or (json_field or "answer") not in obj:
            return None
        return json.dumps(obj[json_field or "answer"], sort_keys=True)
    raise InvalidRequest(f"unknown answer mode {mode!r}; one of {', '.join(ANSWER_MODES)}", param="test_time.answer")


def vote(cands: Sequence[Candidate]) -> tuple[str | None, list[tuple[str, int]]]:
    """Majority answer and the vote table; chains without an answer do not vote; a tie goes to the
    answer whose chains have the higher total log-probability, then to the one seen first."""
    counts = Counter(c.answer for c in cands if c.answer is not None)
    if not counts:
        return None, []
    mass: dict[str, float] = {}
    first: dict[str, int] = {}
    for c in cands:
        if c.answer is not None:
            mass[c.answer] = mass.get(c.answer, 0.0) + c.logprob
            first.setdefault(c.answer, c.index)
    table = sorted(counts.items(), key=lambda kv: (-kv[1], -mass[kv[0]], first[kv[0]]))
    return table[0][0], table


def self_consistency(
    sample: Callable[[int], list[Candidate]],
    n: int,
    answer: str = "last_number",
    pattern: str | None = None,
    json_field: str | None = None,
) -> TestTimeResult:
    cands = sample(n)
    for c in cands:
        c.answer = extract_answer(c.text, answer, pattern, json_field)
    winner, table = vote(cands)
    chosen = next((c for c in cands if winner is not None and c.answer == winner), cands[0])
    return TestTimeResult(
        "self_consistency", chosen.text, winner, cands, table, completion_tokens=sum(c.tokens for c in cands)
    )


def best_of_n(
    sample: Callable[[int], list[Candidate]],
    n: int,
    score: str = "mean_logprob",
    verify: Callable[[str], float] | None = None,
) -> TestTimeResult:
    if score not in SCORES:
        raise InvalidRequest(f"unknown score {score!r}; one of {', '.join(SCORES)}", param="test_time.score")
    cands = sample(n)
    for c in cands:
        if score == "verifier":
            if verify is None:
                raise InvalidRequest("the verifier score needs a question to verify against", param="test_time.score")
            c.score = verify(c.text)
        else:
            c.score = c.mean_logprob if score == "mean_logprob" else c.logprob
    best = max(cands, key=lambda c: (c.score, -c.index))
    return TestTimeResult("best_of_n", best.text, None, cands, completion_tokens=sum(c.tokens for c in cands))


def refinement(
    ask: Callable[[list[dict]], tuple[str, int]],
    messages: list[dict],
    rounds: int,
    critique_prompt: str | None = None,
    revise_prompt: str | None = None,
) -> TestTimeResult:
    text, used = ask(messages)
    convo = list(messages) + [{"role": "assistant", "content": text}]
    out = TestTimeResult("refinement", text, candidates=[Candidate(0, text, used)], completion_tokens=used)
    for _ in range(rounds):
        critique, u1 = ask(convo + [{"role": "user", "content": critique_prompt or CRITIQUE_PROMPT}])
        revised, u2 = ask(
            convo
            + [
                {"role": "user", "content": critique_prompt or CRITIQUE_PROMPT},
                {"role": "assistant", "content": critique},
                {"role": "user", "content": revise_prompt or REVISE_PROMPT},
            ]
        )
        out.rounds.append({"critique": critique, "revision": revised})
        out.completion_tokens += u1 + u2
        convo = list(messages) + [{"role": "assistant", "content": revised}]
        out.text = revised
    return out


def yes_probability(top: Sequence[tuple[int, str, float]]) -> float:
    """P(yes) / (P(yes) + P(no)) from a first token's top log-probabilities (0.5 when neither shows)."""
    yes = sum(math.exp(lp) for _, t, lp in top if t.strip().lower() in ("yes", "y"))
    no = sum(math.exp(lp) for _, t, lp in top if t.strip().lower() in ("no", "n"))
    return 0.5 if yes + no == 0 else yes / (yes + no)


def check_request(spec: dict) -> dict:
    """Validate the server's ``test_time`` request extension; returns it with defaults filled in."""
    if not isinstance(spec, dict):
        raise InvalidRequest("test_time must be an object", param="test_time")
    known = {"strategy", "n", "answer", "pattern", "field", "score", "rounds", "critique_prompt", "revise_prompt"}
    extra = set(spec) - known
    if extra:
        raise InvalidRequest(f"test_time has unknown fields: {', '.join(sorted(extra))}", param="test_time")
    s = dict(spec)
    if s.get("strategy") not in STRATEGIES:
        raise InvalidRequest(f"test_time.strategy must be one of {', '.join(STRATEGIES)}", param="test_time.strategy")
    n = s.setdefault("n", 8)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequest(f"test_time.n must be an integer in [1, {MAX_N}]", param="test_time.n")
    ans = s.setdefault("answer", "last_number")
    if ans == "number":
        s["answer"] = ans = "last_number"
    if ans not in ANSWER_MODES:
        raise InvalidRequest(f"test_time.answer must be one of {', '.join(ANSWER_MODES)}", param="test_time.answer")
    if ans == "regex":
        try:
            re.compile(s.get("pattern") or "")
        except (re.error, TypeError) as exc:
            raise InvalidRequest(
                f"test_time.pattern is not a valid regular expression: {exc}", param="test_time.pattern"
            ) from None
        if not s.get("pattern"):
            raise InvalidRequest("test_time.answer 'regex' needs test_time.pattern", param="test_time.pattern")
    if s.setdefault("score", "mean_logprob") not in SCORES:
        raise InvalidRequest(f"test_time.score must be one of {', '.join(SCORES)}", param="test_time.score")
    r = s.setdefault("rounds", 1)
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 8:
        raise InvalidRequest("test_time.rounds must be an integer in [0, 8]", param="test_time.rounds")
    for k in ("critique_prompt", "revise_prompt", "pattern", "field"):
        if s.get(k) is not None and not isinstance(s[k], str):
            raise InvalidRequest(f"test_time.{k} must be a string", param=f"test_time.{k}")
    return s


# ------------------------------------------------------------------ running on an engine
def engine_sample(engine: Any, prompt: list[int], params: Any) -> Callable[[int], list[Candidate]]:
    """``sample`` over an Engine: N chains submitted as one group (one batch, the prompt prefilled
    once and forked where the engine can: fork.py), each with logprobs."""
    from dataclasses import replace

    from .outputs import submit_choices

    def sample(n: int) -> list[Candidate]:
        base = replace(params, logprobs=True, top_logprobs=0)
        sinks = submit_choices(engine, prompt, [base.for_choice(i) for i in range(n)])
        out = []
        for i, sink in enumerate(sinks):
            c = Candidate(i, "")
            for ev in sink:
                if ev.error:
                    raise RuntimeError(f"generation failed: {ev.error}")
                c.text += ev.text
                c.tokens += len(ev.token_ids)
                c.logprob += sum(x.logprob for x in ev.logprobs)
            out.append(c)
        return out

    return sample


def engine_ask(
    engine: Any, params: Any, template_kwargs: dict | None = None
) -> Callable[[list[dict]], tuple[str, int]]:
    """``ask`` over an Engine: one completion of a chat, the text and its token count."""
    from dataclasses import replace

    from .outputs import SyncSink

    def ask(messages: list[dict]) -> tuple[str, int]:
        sink = SyncSink()
        engine.submit(engine.chat_prompt(messages, **(template_kwargs or {})), replace(params, n=1), sink)
        text, n = "", 0
        for ev in sink:
            if ev.error:
                raise RuntimeError(f"generation failed: {ev.error}")
            text += ev.text
            n += len(ev.token_ids)
        return text, n

    return ask


def engine_verify(engine: Any, question: str, template_kwargs: dict | None = None) -> Callable[[str], float]:
    """The verifier score: P(Yes) for 'is this answer correct?' on the same model."""
    from .outputs import SyncSink
    from .sampling import SamplingParams

    def verify(answer: str) -> float:
        msgs = [{"role": "user", "content": VERIFY_PROMPT.format(question=question, answer=answer)}]
        sink = SyncSink()
        engine.submit(
            engine.chat_prompt(msgs, **(template_kwargs or {})),
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=True, top_logprobs=20),
            sink,
        )
        top: list = []
        for ev in sink:
            if ev.error:
                raise RuntimeError(f"generation failed: {ev.error}")
            for x in ev.logprobs:
                top = list(x.top) or [(x.token, x.text, x.logprob)]
        return yes_probability(top)

    return verify


def run(
    engine: Any,
    messages: list[dict],
    params: Any,
    spec: dict,
    template_kwargs: dict | None = None,
    prompt: list[int] | None = None,
) -> TestTimeResult:
    """One request's strategy (``spec`` as ``check_request`` returns it) on ``engine``; ``prompt``:
    the messages already rendered (the server's, with its tools and media), else rendered here."""
    s = check_request(spec)
    if s["strategy"] == "refinement":
        return refinement(
            engine_ask(engine, params, template_kwargs),
            messages,
            s["rounds"],
            s.get("critique_prompt"),
            s.get("revise_prompt"),
        )
    if prompt is None:
        prompt = engine.chat_prompt(messages, **(template_kwargs or {}))
    sample = engine_sample(engine, prompt, params)
    if s["strategy"] == "self_consistency":
        return self_consistency(sample, s["n"], s["answer"], s.get("pattern"), s.get("field"))
    question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    verify = (
        engine_verify(engine, question if isinstance(question, str) else json.dumps(question), template_kwargs)
        if s["score"] == "verifier"
        else None
    )
    return best_of_n(sample, s["n"], s["score"], verify)
