"""Request bodies of the OpenAI routes (pydantic, strict types, unknown fields ignored)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

# template arguments the server fills in itself (a request's chat_template_kwargs may not shadow them)
SERVER_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
MAX_TOOLS = 128  # as OpenAI
MAX_CHOICES = 16  # n and best_of: choices generated for one prompt


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Req):
    include_usage: bool = False


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Sampling(_Req):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    # generate best_of choices (one prefill, forked) and return the n with the highest logprob; checked
    # against n and MAX_CHOICES by the route (a 400 naming best_of).  An extension on chat completions.
    best_of: int | None = None
    best_of_rank: Literal["cumulative", "mean"] = "cumulative"  # SwiftLM: sum of logprobs (OpenAI) or per token
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    user: str | None = None
    # SwiftLM extensions: this request's KV-cache format (validated in SamplingParams)
    turbo_kv: str | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = None
    # SwiftLM extension: test-time compute over N chains of this request (swiftlm.test_time.check_request)
    test_time: dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_server_owned(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(set(v or {}) & SERVER_TEMPLATE_KWARGS)
        if clash:
            raise ValueError(
                f"{', '.join(clash)} cannot be set here: the server passes "
                f"{'it' if len(clash) == 1 else 'them'} to the template itself"
            )
        return v


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None


# ---------------------------------------------------------------- OpenAI Responses API
class ResponsesText(_Req):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # accepted, ignored


class ResponsesReasoning(_Req):
    effort: str | None = None  # none / minimal: thinking off; low / medium / high / xhigh: on
    summary: str | None = None  # accepted, ignored (reasoning comes back whole)
    generate_summary: str | None = None


class ResponsesRequest(_Req):
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # SwiftLM extensions (not in OpenAI's API): the sampling fields chat completions also takes
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)


# ---------------------------------------------------------------- Anthropic Messages API
class AnthropicCountTokensRequest(_Req):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # accepted, ignored
    seed: int | None = None  # SwiftLM extension
