"""The Python API: ``LLM`` (blocking) and ``AsyncLLM`` (asyncio).

from swiftlm import LLM, SamplingParams
llm = LLM()                                   # bundled SmolLM2, auto backend
out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
print(out.text)
for delta in llm.stream([{"role": "user", "content": "Hi"}]):
    print(delta.text, end="")
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Union

from .backend import choose_backend
from .config import Settings
from .engine import AsyncSink, Engine, Event, SyncSink, TokenLogprob
from .errors import ConfigError
from .outputs import submit_choices
from .registry import ModelSpec, resolve
from .sampling import SamplingParams

log = logging.getLogger(__name__)

Chat = list[dict[str, Any]]
PromptLike = Union[str, Chat, list[int]]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache
    # chat() only: the text split into answer, reasoning and tool calls
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[Any] = field(default_factory=list)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def usage(self) -> dict[str, int]:
        completion = sum(len(o.token_ids) for o in self.outputs)
        prompt = len(self.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cached_tokens": max((o.cached_tokens for o in self.outputs), default=0),
        }


@dataclass
class StreamDelta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


def _is_batch(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return False
    if isinstance(prompts, list) and prompts:
        first = prompts[0]
        if isinstance(first, dict) or isinstance(first, int):
            return False
        return True
    return False


def build_engine(settings: Settings) -> tuple[Engine, ModelSpec, str]:
    """Resolve the model, choose the backend, load, and start an engine."""
    settings.check_supported()
    spec = resolve(settings.model, allow_download=False if settings.offline else None)
    backend, why = choose_backend(settings.backend)
    log.info("loading %s with backend %s", spec.name, why)
    return make_engine(settings, backend, spec), spec, why


def check_engine_settings(settings: Settings, backend: Any) -> None:
    """Settings that do not fit together or with ``backend``, refused in one sentence.  ``make_engine``
    runs this before it loads anything; ``swiftlm serve`` before it binds its port."""
    if settings.tensor_parallel > 1 and settings.data_parallel > 1:
        raise ConfigError("--data-parallel cannot be combined with --tensor-parallel yet")
    pipeline = (settings.pipeline_parallel or 1) > 1
    if pipeline and settings.data_parallel > 1:
        raise ConfigError("--data-parallel cannot be combined with --pipeline-parallel yet")
    if settings.gpu_layers is not None and getattr(backend, "name", "") != "torch":
        raise ConfigError(
            f"--gpu-layers is built for the torch backend only (this is {backend.name}): the MLX "
            "backend keeps every layer on the GPU of Apple's unified memory"
        )
    if settings.adapter and (settings.speculative or settings.draft_model):
        raise ConfigError(
            "--adapter does not combine with speculative decoding yet (drafts would be verified on "
            "the base weights, not the adapter's)"
        )
    if settings.speculative == "draft" and not settings.draft_model:
        raise ConfigError("--speculative draft needs --draft-model")
    if settings.distributed:  # one rank of an mlx.launch group: no replicas, no engine child process
        from .distributed.external import check_settings as check_distributed

        check_distributed(settings, backend)
    if settings.data_parallel > 1:
        from .distributed.replicas import check_settings as check_replicas

        check_replicas(settings, backend)


def make_engine(settings: Settings, backend: Any, spec: ModelSpec) -> Engine:
    """Load the model (and a draft model) with ``backend`` and start the engine."""
    check_engine_settings(settings, backend)
    if settings.data_parallel > 1:  # N engines, one per device, behind one interface
        from .distributed.replicas import build_replicas

        return build_replicas(settings, backend, spec, make_engine)  # type: ignore[return-value]
    from .engine_process import EngineClient, wanted

    if wanted(settings, backend):  # --engine-process: the model and the step loop (and rank 0) in a child process
        return EngineClient(settings, backend, spec)  # type: ignore[return-value]
    return load_engine(settings, backend, spec)


def load_engine(settings: Settings, backend: Any, spec: ModelSpec, **engine_kw: Any) -> Engine:
    """Load the model (and a draft model) in this process and start its engine thread."""
    draft_spec = None
    if settings.draft_model and settings.speculative in (None, "draft"):  # a bad draft fails before the big load
        draft_spec = resolve(settings.draft_model, allow_download=False if settings.offline else None)
    from .media import MediaPolicy, processor_for
    from .media.processor import check_settings

    check_settings(spec, settings)
    if settings.tensor_parallel > 1 or (settings.pipeline_parallel or 1) > 1:  # ranks 1..N-1 elsewhere; this is 0
        from .distributed.launch import load_parallel

        model = load_parallel(backend, spec, settings)
    elif settings.distributed:  # started by mlx.launch: rank 0 returns here; the others follow it and exit
        from .distributed.external import load_distributed

        model = load_distributed(backend, spec, settings)
    else:
        model = backend.load(spec, settings)
    if settings.adapter and model.lora is None:
        raise ConfigError(f"--adapter is built for the torch backend only (this is {backend.name})")
    from .embeddings import is_embedding_only, pooling_for

    model.info.embedding_only = is_embedding_only(spec.config or {})
    model.info.pooling = pooling_for(spec)
    speculator = _speculator(settings, backend, model, draft_spec)
    processor = processor_for(spec, model.tokenizer)
    engine = Engine(
        model,
        max_running=settings.parallel,
        prefill_size=settings.prefill_size,
        max_batched_tokens=settings.max_batched_tokens,
        max_queue=settings.max_queue,
        ctx_size=settings.ctx_size,
        default_max_tokens=settings.max_tokens,
        prompt_cache_bytes=settings.prompt_cache_bytes,
        speculator=speculator,
        kv_budget_bytes=settings.kv_budget_bytes,
        request_timeout=settings.request_timeout,
        **engine_kw,
    )
    engine.json_close, engine.json_repeat_guard = settings.json_close, settings.json_repeat_guard
    engine.backend_name = backend.name
    engine.tool_parser = settings.tool_parser
    engine.media_processor = processor
    engine.media_policy = MediaPolicy.from_settings(settings, processor.modalities if processor else (), spec.arch)
    if settings.tensor_parallel > 1 or (settings.pipeline_parallel or 1) > 1 or settings.distributed:
        model.on_failure = lambda msg: _rank_failed(engine, msg)
    waves = model.warm_up_waves() if settings.warm_up else []
    if waves:
        from .warm_up import warm_up

        log.info("warming up: %d scratch requests (kernel compiles, CUDA graph captures)", sum(map(len, waves)))
        try:
            log.info("warmed up in %.1f s", sum(warm_up(engine, w, model.info.vocab_size) for w in waves))
        except Exception as exc:  # a speed-up only: the first requests then pay the compiles
            log.warning("start-up warm-up failed (%s); serving without it", exc)
    return engine


def _rank_failed(engine: Engine, msg: str) -> None:
    """A tensor-parallel rank died (distributed.control.Leader's watchdog): refuse new requests, end
    every open request with the error at once, and stop the server as a dead engine loop does.  On
    CUDA the step in flight may never fail on its own (NCCL waits on the dead peer, so the streams
    would get no error until the server's shutdown cut them).  In an engine process, ``on_fatal``
    sends the message to the server's process (engine_child.py), which ends the streams there."""
    engine.fatal = engine.fatal or msg
    engine.end_streams_now(msg)  # on CUDA the loop may sit in an NCCL collective on the dead peer
    if engine.on_fatal is not None:
        engine.on_fatal(msg)


def _speculator(settings: Settings, backend: Any, model: Any, dspec: ModelSpec | None) -> Any:
    from .speculative import ModelDrafter, NgramDrafter, Speculator

    mode = settings.speculative or ("draft" if settings.draft_model else None)
    if mode is None:
        return None
    if not model.can_score:
        raise ConfigError(f"speculative decoding: backend {backend.name!r} cannot verify drafts (no Model.score)")
    if mode == "ngram":
        drafter: Any = NgramDrafter()
    else:
        assert dspec is not None, "check_engine_settings refuses --speculative draft without --draft-model"
        log.info("loading draft model %s", dspec.name)
        dmodel = backend.load(dspec, settings)
        check_same_tokenizer(model.tokenizer, dmodel.tokenizer, dspec.name)
        drafter = ModelDrafter(dmodel)
    log.info("speculative decoding: %s, %d draft tokens per step", drafter.name, settings.num_draft_tokens)
    return Speculator(model, drafter, settings.num_draft_tokens)


def check_same_tokenizer(target: Any, draft: Any, name: str) -> None:
    """A draft proposes token ids: they must mean the same text for both models."""
    tv, dv = target.tok.get_vocab(with_added_tokens=True), draft.tok.get_vocab(with_added_tokens=True)
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise ConfigError(
            f"draft model {name} has a different tokenizer from the target ({len(dv)} vs {len(tv)} "
            f"tokens, {diff} entries differ); speculative decoding needs the same vocabulary"
        )


class _Base:
    def __init__(self, model: str | None = None, *, backend: str = "auto", **settings: Any):
        if "engine_process" not in settings and not os.environ.get("SWIFTLM_ENGINE_PROCESS"):
            # the Python API has no HTTP event loop competing for the GIL: --engine-process auto is the
            # server's rule (on for torch on CUDA); here the engine stays on a thread unless asked
            settings["engine_process"] = "off"
        self.settings = Settings(model=model, backend=backend, **settings)
        self.engine, self.spec, self.backend_choice = build_engine(self.settings)
        self.tokenizer = self.engine.tokenizer

    def _tokens(self, prompt: PromptLike, chat_template_kwargs: dict | None = None) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.text_prompt(prompt)
        if hasattr(prompt, "media"):  # a MediaPrompt (encode_plan's ids with the decoded media): as it is
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        kwargs = dict(chat_template_kwargs or {})
        kwargs.setdefault("enable_thinking", self.settings.thinking)
        return self.engine.chat_prompt(prompt, **kwargs)

    def _plan(self, messages: Chat, tools: Any, tool_choice: Any, chat_template_kwargs: dict | None) -> Any:
        kwargs = dict(chat_template_kwargs or {})
        thinking = bool(kwargs.pop("enable_thinking", self.settings.thinking))
        return self.engine.plan_chat(
            messages, tools=tools, tool_choice=tool_choice, thinking=thinking, template_kwargs=kwargs
        )

    @staticmethod
    def _params(params: SamplingParams | None, i: int) -> SamplingParams:
        return (SamplingParams() if params is None else params).for_choice(i)

    def close(self) -> None:
        self.engine.shutdown()
        self.engine.model.close()  # --tensor-parallel: the other ranks exit (ModelHooks: a no-op by default)

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _collect(out: CompletionOutput, ev: Event) -> None:
    out.text += ev.text
    out.token_ids += ev.token_ids
    out.logprobs += ev.logprobs
    out.cached_tokens = max(out.cached_tokens, ev.cached_tokens)
    if ev.finished:
        out.finish_reason = ev.finish_reason
        if ev.error:
            raise RuntimeError(f"generation failed: {ev.error}")


def _split(out: CompletionOutput, plan: Any) -> None:
    out.content, out.reasoning_content, out.tool_calls, out.finish_reason = plan.parser().result(
        out.text, out.finish_reason
    )


class LLM(_Base):
    """Blocking API.  The model runs on the engine's own background thread."""

    def generate(
        self,
        prompts: PromptLike | list[PromptLike],
        params: SamplingParams | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        batch = prompts if _is_batch(prompts) else [prompts]
        n = params.n if params else 1
        prompts_toks = [self._tokens(prompt, chat_template_kwargs) for prompt in batch]
        jobs = []
        with getattr(self.engine, "together", contextlib.nullcontext)():  # the batch is admitted as one
            for toks in prompts_toks:
                # n > 1: one group, the prompt prefilled once (fork.py)
                jobs.append((toks, submit_choices(self.engine, toks, [self._params(params, i) for i in range(n)])))
        results = []
        for toks, sinks in jobs:
            outs = []
            for i, sink in enumerate(sinks):
                out = CompletionOutput(i)
                for ev in sink:
                    _collect(out, ev)
                outs.append(out)
            results.append(RequestOutput(toks, outs))
        return results if _is_batch(prompts) else results[0]

    def chat(
        self,
        messages: Chat,
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: Any = None,
        chat_template_kwargs: dict | None = None,
    ) -> RequestOutput:
        """One chat turn.  Each output's ``text`` is the raw model text; ``content``,
        ``reasoning_content`` and ``tool_calls`` (chat.tool_calls.ToolCall) are the parsed parts."""
        plan = self._plan(messages, tools, tool_choice, chat_template_kwargs)
        params = params or SamplingParams()
        if plan.grammar is not None:
            params = replace(params, grammar=plan.grammar)
        toks = self.engine.encode_plan(plan)  # with the plan's images / audio (plain ids dropped them)
        out = self.generate(toks, params)
        for o in out.outputs:  # type: ignore[union-attr]
            _split(o, plan)
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------- test-time compute (swiftlm.test_time)
    def _test_time(self, prompt: Any, params: SamplingParams | None, spec: dict, kwargs: dict | None) -> Any:
        from . import test_time

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        tk = dict(kwargs or {})
        tk.setdefault("enable_thinking", self.settings.thinking)
        p = params or SamplingParams(temperature=0.7 if spec["strategy"] != "refinement" else 0.0, max_tokens=256)
        return test_time.run(self.engine, messages, p, spec, tk)

    def generate_with_self_consistency(
        self,
        prompt: Any,
        n: int = 8,
        params: SamplingParams | None = None,
        *,
        answer: str = "last_number",
        pattern: str | None = None,
        json_field: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> Any:
        """N sampled chains in one batch, an answer extracted from each, majority vote
        (``TestTimeResult``: ``answer``, ``votes``, ``candidates``)."""
        return self._test_time(
            prompt,
            params,
            {"strategy": "self_consistency", "n": n, "answer": answer, "pattern": pattern, "field": json_field},
            chat_template_kwargs,
        )

    def generate_best_of_n(
        self,
        prompt: Any,
        n: int = 8,
        params: SamplingParams | None = None,
        *,
        score: str = "mean_logprob",
        chat_template_kwargs: dict | None = None,
    ) -> Any:
        """N sampled chains in one batch; the best by the model's log-probability (or a verifier prompt)."""
        return self._test_time(prompt, params, {"strategy": "best_of_n", "n": n, "score": score}, chat_template_kwargs)

    def generate_with_refinement(
        self,
        prompt: Any,
        rounds: int = 2,
        params: SamplingParams | None = None,
        *,
        critique_prompt: str | None = None,
        revise_prompt: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> Any:
        """Answer, then ``rounds`` x (critique -> revise) on the same model."""
        return self._test_time(
            prompt,
            params,
            {
                "strategy": "refinement",
                "rounds": rounds,
                "critique_prompt": critique_prompt,
                "revise_prompt": revise_prompt,
            },
            chat_template_kwargs,
        )

    def stream(
        self, prompt: PromptLike, params: SamplingParams | None = None, chat_template_kwargs: dict | None = None
    ) -> Iterator[StreamDelta]:
        toks = self._tokens(prompt, chat_template_kwargs)
        sink = SyncSink()
        seq_id = self.engine.submit(toks, self._params(params, 0), sink)
        finished = False
        try:
            for ev in sink:
                if ev.progress is not None:  # prefill progress: nothing to hand out
                    continue
                if ev.error:
                    raise RuntimeError(f"generation failed: {ev.error}")
                finished = ev.finished
                yield StreamDelta(0, ev.text, ev.token_ids, ev.finish_reason, ev.logprobs)
        finally:
            if not finished:  # the caller stopped iterating: free the slot
                self.engine.cancel(seq_id)


class AsyncLLM(_Base):
    """asyncio API: ``await llm.generate(...)`` and ``async for d in llm.stream(...)``."""

    async def generate(
        self, prompt: PromptLike, params: SamplingParams | None = None, chat_template_kwargs: dict | None = None
    ) -> RequestOutput:
        toks = self._tokens(prompt, chat_template_kwargs)
        n = params.n if params else 1
        sinks = []
        for i in range(n):
            sink = AsyncSink()
            self.engine.submit(toks, self._params(params, i), sink)
            sinks.append(sink)
        outs = []
        for i, sink in enumerate(sinks):
            out = CompletionOutput(i)
            async for ev in sink:
                _collect(out, ev)
            outs.append(out)
        return RequestOutput(toks, outs)

    async def stream(
        self, prompt: PromptLike, params: SamplingParams | None = None, chat_template_kwargs: dict | None = None
    ) -> AsyncIterator[StreamDelta]:
        toks = self._tokens(prompt, chat_template_kwargs)
        sink = AsyncSink()
        seq_id = self.engine.submit(toks, self._params(params, 0), sink)
        finished = False
        try:
            async for ev in sink:
                if ev.progress is not None:
                    continue
                if ev.error:
                    raise RuntimeError(f"generation failed: {ev.error}")
                finished = ev.finished
                yield StreamDelta(0, ev.text, ev.token_ids, ev.finish_reason, ev.logprobs)
        finally:
            if not finished:
                self.engine.cancel(seq_id)
