"""The prompt side of a request, shared by the engine and the engine-process client (each owns a
``Prompts``): prompt rendering (chat templates, tool plans, media expansion) and the checks that make
a submission a 4xx (or a 503).  Runs in the caller's thread; touches no model state."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from .chat.messages import normalize_messages
from .errors import InvalidRequest
from .sampling import SamplingParams
from .slots import Lifecycle, QueueFull


def pooled(raw: Future[list[Any]], mode: str, dimensions: int | None) -> Future[list[Any]]:
    """A future of the pooled, L2-normalised embeddings of ``raw``'s hidden states."""
    from .embeddings import embed

    out: Future[list[Any]] = Future()

    def done(f: Future) -> None:
        try:
            hidden = f.result()
            if dimensions and hidden and dimensions > hidden[0].shape[-1]:
                raise InvalidRequest(
                    f"'dimensions' is {dimensions} but the model's vectors have {hidden[0].shape[-1]}",
                    param="dimensions",
                )
            out.set_result(embed(hidden, mode, dimensions))
        except Exception as exc:
            out.set_exception(exc)

    raw.add_done_callback(done)
    return out


class Prompts:
    """Prompt rendering and request checks for one served model.  ``model``: what the checks read of it
    (``lora``: the adapters served; the engine process's client passes its view of the child's model);
    ``life``: the owner's ``Lifecycle`` (a dead or stopping engine refuses).  ``tool_parser``,
    ``media_policy`` and ``media_processor`` are set by whoever builds the engine (make_engine)."""

    def __init__(self, tokenizer: Any, info: Any, ctx_size: int, model: Any, life: Lifecycle):
        self.tokenizer = tokenizer
        self.info = info
        self.ctx_size = ctx_size
        self.model = model
        self.life = life
        self.tool_parser = "auto"  # chat.tool_calls format, or auto (from the chat template)
        from .media import MediaPolicy

        self.media_policy = MediaPolicy()  # make_engine sets the model's and the flags' policy
        self.media_processor: Any = None  # media.MediaProcessor for multimodal models

    def chat_prompt(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of a rendered chat; with image/audio parts a ``MediaPrompt`` carrying the arrays."""
        bag: list = []
        msgs = normalize_messages(messages, (self.media_policy, bag))
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self._encode(text, bag)

    def plan_chat(self, messages: Any, **kw: Any) -> Any:
        """Render a chat request with tools / tool_choice / thinking: see chat.plan.  Decoded media
        ride on ``plan.media``; ``encode_plan`` turns the plan into prompt ids."""
        from .chat.plan import plan_chat

        kw.setdefault("tool_parser", self.tool_parser)
        bag: list = []
        plan = plan_chat(self.tokenizer, normalize_messages(messages, (self.media_policy, bag)), **kw)
        plan.media = bag
        return plan

    def encode_plan(self, plan: Any) -> list[int]:
        return self._encode(plan.text, plan.media)

    def _encode(self, text: str, media: list) -> list[int]:
        if not media:
            return self.tokenizer.encode(text, add_special_tokens=False)
        from .media.processor import expand

        # media only get here through a policy that make_engine derived from this processor
        return expand(text, media, self.media_processor, self.tokenizer)

    def text_prompt(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest("'prompt' must be a string", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def check(self, prompt_tokens: list[int], params: SamplingParams) -> None:
        """What makes a submission a 4xx (or a 429/503), raised in the caller's thread."""
        if self.info.embedding_only:
            raise InvalidRequest("this model has no language-model head: it serves /v1/embeddings only", param="model")
        why = self.life.refusal()
        if why is not None:
            raise QueueFull(why)
        params.validate(self.info.vocab_size)
        lora = self.model.lora  # (the engine process's model view: the adapters the child serves)
        if params.adapter and params.adapter not in (lora.names if lora is not None else ()):
            raise InvalidRequest(f"LoRA adapter {params.adapter!r} is not loaded on this model", param="model")
        if not prompt_tokens:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt_tokens) >= self.ctx_size:
            raise InvalidRequest(
                f"the prompt has {len(prompt_tokens)} tokens but the context is {self.ctx_size}", param="messages"
            )
        if any(not 0 <= t < self.info.vocab_size for t in prompt_tokens):
            raise InvalidRequest("the prompt contains token ids outside the vocabulary", param="prompt")

    def check_embed(self, prompts: list[list[int]]) -> None:
        if self.life.stopping:
            raise QueueFull("the server is shutting down")
        for p in prompts:
            if not p:
                raise InvalidRequest("an embedding input is empty", param="input")
            if len(p) > self.ctx_size:
                raise InvalidRequest(
                    f"an embedding input has {len(p)} tokens but the context is {self.ctx_size}", param="input"
                )
            if min(p) < 0 or max(p) >= self.info.vocab_size:
                raise InvalidRequest("an embedding input contains token ids outside the vocabulary", param="input")


class PromptFront:
    """The prompt methods of an engine (``Engine``, ``EngineClient``), answered by its ``prompts`` part."""

    prompts: Prompts

    def text_prompt(self, text: str) -> list[int]:
        return self.prompts.text_prompt(text)

    def chat_prompt(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        return self.prompts.chat_prompt(messages, add_generation_prompt, **template_kwargs)

    def plan_chat(self, messages: Any, **kw: Any) -> Any:
        return self.prompts.plan_chat(messages, **kw)

    def encode_plan(self, plan: Any) -> list[int]:
        return self.prompts.encode_plan(plan)
