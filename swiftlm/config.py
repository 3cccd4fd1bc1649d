"""Every setting, defined once.

Each field is a ``SWIFTLM_<NAME>`` environment variable and a ``--name`` CLI flag (flags
override the environment); its ``description`` is the help text for both.  Features that
are planned but not built yet are marked ``not_built``: setting them exits with a clear
message instead of being silently ignored.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError, NotSupportedYet


def _f(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    group: str = "model",
    not_built: str | None = None,
    nargs: str | None = None,
    const: Any = None,
    append: bool = False,
    no_flag: bool = False,
    aliases: tuple[str, ...] = (),
) -> Any:
    extra: dict[str, Any] = {"group": group}
    if aliases:
        extra["aliases"] = list(aliases)
    if append:
        extra["append"] = True
    if no_flag:
        extra["no_flag"] = True
    if flag:
        extra["flag"] = flag
    if not_built:
        extra["not_built"] = not_built
    if nargs:
        extra["nargs"] = nargs
        extra["const"] = const
    return Field(default, description=help, json_schema_extra=extra)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWIFTLM_", extra="ignore", protected_namespaces=())

    # model and backend
    model: str | None = _f(
        None,
        "Model: HF repo id (from the local HF cache), a local HF-format directory, a .gguf "
        "file, or 'smollm2-135m-instruct' (the bundled default, used when omitted). "
        "Repeat --model to serve several (the first loads at start-up, the others on "
        "demand; see --models-file).",
        append=True,
        aliases=("-m",),
    )
    adapter: list[str] = _f(
        [],
        "LoRA adapter NAME=PATH (a PEFT or mlx-lm adapter directory) served on the first "
        "--model; a request selects it with model=NAME or BASE:NAME. Repeatable (torch "
        "backend).",
        append=True,
    )
    backend: str = _f(
        "auto",
        "Backend plugin: 'auto' (macOS arm64 -> mlx; CUDA -> torch; Linux CPU -> torch when "
        "installed, else mlx), or a name listed by `swiftlm info`.",
    )
    offline: bool = _f(False, "Never download from the Hugging Face hub (HF_HUB_OFFLINE=1 does the same).")
    ctx_size: int | None = _f(
        None,
        "Context length in tokens (prompt + output); default: the model's own.",
        flag="--ctx-size",
        aliases=("-c",),
    )
    prefill_size: int = _f(
        512, "Prompt tokens processed per sequence per engine step (chunked prefill).", group="engine"
    )
    parallel: int = _f(
        1,
        "Sequences decoded concurrently (vLLM's --max-num-seqs); more requests wait in the queue.",
        group="engine",
        aliases=("-np", "--max-num-seqs"),
    )
    kv_block_size: int = _f(64, "Positions per block of the paged KV cache (torch backend on CUDA).", group="engine")
    kv_cache_memory: str | None = _f(
        None,
        "Device memory for the paged KV cache (torch backend on CUDA), e.g. 20GB; "
        "its blocks bound how many tokens the running sequences hold together. "
        "Default: room for every --parallel sequence at full context, capped at "
        "90 percent of the device memory free after loading. With --turbo-kv "
        "it sizes the pages of TurboQuant codes instead.",
        group="engine",
    )
    max_batched_tokens: int = _f(
        0,
        "Tokens one engine step may process (decode rows plus prompt chunks; 0: "
        "max(prefill-size, parallel) + parallel; at least parallel + 1).  Larger lets a wave of new prompts prefill in fewer "
        "steps at the cost of longer steps for the streams already decoding.",
        group="engine",
    )
    engine_process: str = _f(
        "auto",
        "Run the model and the engine's step loop in a child process (on), or on a "
        "thread of the server's process (off); auto: on when `swiftlm serve` runs the "
        "torch backend on CUDA, off otherwise (the Python API's LLM: off unless set). The child keeps the step loop clear of the HTTP "
        "server's Python work (the GIL).",
        group="engine",
    )
    data_parallel: int = _f(
        1,
        "Data-parallel replicas: N engines (torch backend), one per GPU (cuda:0..N-1; on a "
        "CPU-only machine N engines on the CPU) behind one server; each request goes to the "
        "least-loaded replica, with prefix affinity (see docs/guide/distributed.md).",
        group="engine",
    )
    prompt_cache_bytes: int = _f(
        1 << 30,
        "Bytes of KV state kept for prompt (prefix) reuse across requests, LRU (0 disables the prompt cache).",
        group="engine",
    )
    kv_budget_bytes: int = _f(
        0,
        "KV-cache bytes that running sequences may use together (0: no limit beyond "
        "--parallel). Admission waits for room; when running sequences outgrow it, the "
        "newest is preempted and later recomputed.",
        group="engine",
    )
    turbo_kv: str | None = _f(
        None,
        "TurboQuant KV-cache compression for every request: --turbo-kv alone uses the "
        "default preset k4v3; presets k4v3, k3qjl-v3, k3v2 or kXvY / kXqjl-vY (X, Y in "
        "1..4). A request's 'turbo_kv' or 'kv_bits' field overrides it.",
        group="engine",
        nargs="?",
        const="default",
    )
    kv_cache_dtype: str = _f(
        "auto",
        "What the KV cache stores: auto (the model's dtype) or fp8 (float8 e4m3 with per layer and KV head "
        "scales from the checkpoint's k_scale / v_scale, else 1.0; half the bytes of 16-bit KV, so twice the "
        "tokens in the same --kv-cache-memory). Torch backend; not with --turbo-kv.",
        group="engine",
    )
    turbo_kv_window: int = _f(128, "Most recent positions kept in 16-bit by a TurboQuant cache.", group="engine")
    turbo_kv_threshold: int = _f(
        0, "Positions a sequence holds before its TurboQuant cache starts compressing.", group="engine"
    )
    turbo_kv_keep_layers: int = _f(0, "First and last N layers keep a 16-bit cache under TurboQuant.", group="engine")
    warm_up: bool = _f(
        True,
        "Before taking requests, run a few scratch ones where the backend asks for it (the torch backend on CUDA), so "
        "that kernel compiles and CUDA graph captures happen at start-up, not under the first requests; "
        "--no-warm-up turns it off.",
        group="engine",
    )
    turbo_kv_prompt_memory: str = _f(
        "auto",
        "Memory in which prompts of compressed KV caches (TurboQuant, kv_bits; torch backend) are held in 16 bits "
        "while they prefill, to be compressed when they end: a prompt chunk then costs what it costs with 16-bit "
        "KV, and the second token waits for the compression. Prompts past it compress as they go. auto: on CUDA "
        "4GiB, or one whole context of 16-bit rows when --turbo-kv is the default (at most 35 percent of the free "
        "memory, left out of the code pool); off on CPUs, where compressing is arithmetic, not per-chunk overhead.",
        group="engine",
    )
    max_queue: int = _f(64, "Requests allowed to wait for a slot; beyond that the server answers 429.", group="engine")

    # sampling defaults (a request's own fields override them)
    max_tokens: int = _f(2048, "Default maximum tokens to generate per request.", group="sampling")
    temp: float = _f(0.6, "Default sampling temperature (0 = greedy).", group="sampling")
    top_p: float = _f(1.0, "Default nucleus sampling threshold.", group="sampling")
    top_k: int = _f(0, "Default top-k (0 = disabled).", group="sampling")
    min_p: float = _f(0.0, "Default min-p (0 = disabled).", group="sampling")
    repeat_penalty: float = _f(1.0, "Default repetition penalty (1.0 = off).", group="sampling")
    repeat_last_n: int = _f(64, "Tokens of context the repetition penalty looks back over.", group="sampling")
    seed: int | None = _f(
        None, "Default seed for requests that give none (none: a fresh random seed each).", group="sampling"
    )
    thinking: bool = _f(
        False,
        "Enable thinking/reasoning in chat templates that support it; the reasoning comes back as reasoning_content.",
        group="sampling",
    )
    tool_parser: str = _f(
        "auto",
        "Tool-call format to parse: auto (from the chat template), hermes, llama3, mistral, gemma, or none.",
        group="sampling",
    )

    # server
    host: str = _f("127.0.0.1", "Address to bind.", group="server")
    port: int = _f(5413, "Port to listen on.", group="server")
    api_workers: int = _f(
        0,
        "HTTP worker processes sharing the port, each doing tokenisation, chat templates, "
        "detokenisation and streaming for the engine process(es) they all reach (1: the server's one "
        "process).  0 (auto): 1, except when serving several engines (--data-parallel) or "
        "--parallel above 64 with the engine in its own process: min(cores // 4, 2 x engines), at least 1.",
        group="server",
    )
    served_model_name: str | None = _f(
        None,
        "Name the model is served under: the id /v1/models lists and responses' 'model' field "
        "(default: the --model string, or smollm2-135m-instruct for the bundled model).",
        group="server",
        aliases=("-a", "--alias"),
    )
    access_log: bool = _f(
        False,
        "Log one line per request on stderr: method, route, status, model, tokens in and out, "
        "time to first token and duration.",
        group="server",
    )
    quiet: bool = _f(
        False,
        "No loading progress line on stderr (it is drawn only when stderr is a terminal).",
        group="output",
        aliases=("-q",),
    )
    api_key: str | None = _f(None, "Require 'Authorization: Bearer <key>' on /v1 routes.", group="server")
    api_keys_file: str | None = _f(
        None,
        "File of API keys, one per line ('name: key' or just the key; # "
        "comments); any of them (or --api-key) is accepted on /v1 routes.",
        group="server",
    )
    rate_limit: float = _f(
        0.0,
        "Requests per minute allowed per API key (per client address without keys); "
        "beyond it 429 with Retry-After (0: no limit).",
        group="server",
    )
    rate_burst: int = _f(
        0,
        "Requests a key may make at once before --rate-limit applies (0: a tenth of a minute's allowance, at least 1).",
        group="server",
    )
    ssl_certfile: str | None = _f(None, "TLS certificate (PEM): serve HTTPS.", group="server")
    ssl_keyfile: str | None = _f(None, "TLS private key (PEM) for --ssl-certfile.", group="server")
    metrics_need_key: bool = _f(
        False,
        "Also require the API key on /metrics (default: open, like /health, so a local Prometheus can scrape it).",
        group="server",
    )
    cors: str | None = _f(None, "Allowed CORS origin ('*' for any); no CORS headers unless set.", group="server")
    webui: bool = _f(
        True,
        "Serve the built-in chat page at / (its files need no API key; its API calls do); --no-webui turns it off.",
        group="server",
    )
    max_body_bytes: int = _f(8 * 1024 * 1024, "Largest request body accepted (413 beyond).", group="server")
    max_json_depth: int = _f(
        64, "Deepest nesting of lists and objects accepted in a request body (400 beyond).", group="server"
    )
    max_json_items: int = _f(
        8192, "Most items in any one list or object of a request body (400 beyond).", group="server"
    )
    json_close: bool = _f(
        True,
        "Structured output (response_format json_object / json_schema) near max_tokens "
        "ends with the shortest text that completes its JSON, so the content always "
        "parses (finish_reason still 'length'); --no-json-close turns it off.",
        group="sampling",
    )
    json_repeat_guard: int = _f(
        6,
        "Structured output that repeats one block of 3-64 tokens this many times in a "
        "row is completed and ended (finish_reason 'stop'); 0 turns the guard off.",
        group="sampling",
    )
    request_timeout: float = _f(
        0.0,
        "Seconds a request may run from its arrival; past it, it ends with what it "
        "has (finish_reason 'length'; 0: no limit).",
        group="server",
    )
    shutdown_timeout: float = _f(
        10.0,
        "On SIGTERM / Ctrl-C: seconds in-flight requests may keep generating "
        "before they are ended (finish_reason 'length', then [DONE] on streams); "
        "new connections are refused meanwhile.",
        group="server",
    )
    info: bool = _f(False, "Print the model facts and memory plan, then exit.", group="server")

    # many models in one server (server/models.py)
    models_file: str | None = _f(
        None,
        "TOML file of [[models]] entries (name, model, aliases, pin, and per-model "
        "settings such as turbo_kv or ctx_size) served side by side and chosen by "
        "the request's 'model' field; replaces --model.",
        group="models",
    )
    max_loaded_models: int = _f(
        0,
        "Models kept loaded at once (0: no limit); the least recently used idle, "
        "unpinned one is unloaded to make room.",
        group="models",
    )
    models_memory_bytes: int = _f(
        0,
        "Bytes of checkpoints (size on disk) kept loaded at once (0: no limit); "
        "least recently used idle models are unloaded to fit.",
        group="models",
    )
    model_ttl: float = _f(
        0.0, "Seconds a model may stay idle before it is unloaded and its memory returned (0: never).", group="models"
    )
    extra_models: list[str] = _f(
        [], "Models after the first --model (set by repeating --model).", group="models", no_flag=True
    )
    pin: str | None = _f(
        None, "Comma-separated model names kept loaded: never evicted, never unloaded by --model-ttl.", group="models"
    )
    strict_model_names: bool = _f(
        False,
        "With one model, answer an unknown 'model' with 404 model_not_found instead of serving the one model.",
        group="models",
    )
    log_level: str = _f("info", "Log level: debug, info, warning, error.", group="server")

    # planned features: accepted by the parser so that they fail loudly
    mem_limit: str | None = _f(
        None,
        "Cap on the backend's device memory, e.g. 8GB or 512MiB (torch on CUDA: "
        "torch.cuda.set_per_process_memory_fraction; MLX: mx.set_memory_limit).",
        group="engine",
    )
    stream_experts: bool = _f(
        False,
        "SSD expert streaming: keep an MoE model's expert weights on disk and read "
        "only the routed experts' slabs per token and layer.",
        group="experts",
    )
    expert_read_mode: str = _f(
        "pread",
        "How streamed experts are read: pread (concurrent vectored reads into "
        "reusable buffers) or mmap (copies out of a mapping).",
        group="experts",
    )
    expert_read_threads: int = _f(16, "Expert reads in flight at once (thread pool size).", group="experts")
    expert_prefetch: bool = _f(
        False,
        "While a MoE layer computes, guess the next layer's experts with its "
        "router and ask the kernel to start reading them.",
        group="experts",
    )
    expert_top_k: int = _f(
        0,
        "Experts per token at run time (0: the model's value; larger values are clamped "
        "to it). Lowers quality and the bytes read per token.",
        group="experts",
    )
    gpu_layers: int | None = _f(
        None,
        "Partial offload (torch backend): the first N transformer layers on the GPU, "
        "the rest on the CPU in --offload-dtype (embedding, final norm and LM head stay "
        "on the GPU; CUDA graphs off). Default: every layer on the GPU.",
        aliases=("-ngl", "--n-gpu-layers"),
    )
    offload_dtype: str = _f("float32", "dtype of the CPU layers under --gpu-layers: float32 or bfloat16.")
    torch_dtype: str = _f(
        "auto",
        "Weights and activations of the torch backend on a GPU: auto (bfloat16), "
        "bfloat16, float16 or float32 (on the CPU the backend computes in float32).",
    )
    quantize: str | None = _f(
        None,
        "Quantise a 16-bit checkpoint's layer projections at load (torch backend): fp8 (e4m3, one scale per "
        "output channel; FP8 kernels on CUDA, the FP8-rounded weights in float32 on the CPU).",
    )
    device: str | None = _f(
        None,
        "Device of the torch backend: cpu, cuda or cuda:N (default: cuda when available, "
        "else cpu). --data-parallel gives each replica its own.",
    )
    vision: bool = _f(False, "Accept image inputs (OpenAI image_url parts) on a vision-language model.", group="media")
    audio: bool = _f(False, "Accept audio inputs (OpenAI input_audio parts) on an audio-language model.", group="media")
    allow_remote_media: bool = _f(
        False,
        "Let image_url parts name http(s) URLs, which the server then fetches (off: only inline data: URIs).",
        group="media",
    )
    media_dir: str | None = _f(
        None,
        "Let image_url parts name local files (paths or file:// URLs) under this "
        "directory only (off: no file is ever read for a request).",
        group="media",
    )
    max_images: int = _f(8, "Images per request.", group="media")
    max_audio_clips: int = _f(4, "Audio clips per request.", group="media")
    max_image_pixels: int = _f(4096 * 4096, "Largest decoded image (width x height); larger -> 413.", group="media")
    max_audio_seconds: float = _f(60.0, "Longest audio clip in seconds; longer -> 413.", group="media")
    max_media_bytes: int = _f(20 * 1024 * 1024, "Largest encoded media part in bytes; larger -> 413.", group="media")
    speculative: str | None = _f(
        None,
        "Speculative decoding: 'ngram' (prompt lookup: drafts copied from the prompt "
        "and output, no second model) or 'draft' (a draft model; implied by "
        "--draft-model).",
        group="engine",
    )
    draft_model: str | None = _f(
        None,
        "Draft model for speculative decoding (any source --model takes; it must share the target's tokenizer).",
        group="engine",
    )
    num_draft_tokens: int = _f(4, "Tokens drafted per speculative step.", group="engine")

    # distribution (swiftlm/distributed): one model over several processes
    tensor_parallel: int = _f(
        1,
        "Tensor parallelism (torch backend): N ranks, one process per GPU (NCCL; gloo on "
        "a CPU), each holding 1/N of every layer (attention heads, MLP columns, vocabulary); "
        "rank 0 serves and schedules, the others execute its steps.",
        group="distributed",
    )
    pipeline_parallel: int | None = _f(
        None,
        "Pipeline parallelism (torch backend): the layers split into N "
        "contiguous stages, one rank each (send/recv between stages: gloo on "
        "a CPU, NCCL on GPUs); rank 0 holds the last stage, serves and "
        "samples; decode batches run as N micro-batches.",
        group="distributed",
    )
    nnodes: int = _f(
        1,
        "Hosts taking part in --tensor-parallel / --pipeline-parallel; start the same command on "
        "each with its --node-rank (or run under torchrun).",
        group="distributed",
    )
    node_rank: int = _f(
        0, "This host's index among --nnodes hosts (0: rank 0's host, which serves HTTP).", group="distributed"
    )
    master_addr: str = _f(
        "127.0.0.1", "Address of rank 0 for the ranks' rendezvous and its step broadcast.", group="distributed"
    )
    master_port: int = _f(
        0,
        "Port of the ranks' rendezvous on --master-addr (0: a free port on one host, 29500 "
        "with --nnodes > 1; the control socket takes this port, the process group the next).",
        group="distributed",
    )
    distributed: bool = _f(
        False,
        "MLX distributed: run every rank under `mlx.launch` (ring, JACCL or MPI; "
        "mx.distributed gives the rank and size) with the same command; rank 0 serves "
        "HTTP and schedules, the other ranks run its steps on their shard (see "
        "docs/guide/distributed.md).",
        group="distributed",
    )
    distributed_sharding: str = _f(
        "auto",
        "How --distributed splits the model (mlx-lm's sharding): 'tensor' (every "
        "layer split over the ranks), 'pipeline' (contiguous layers per rank), "
        "or 'auto' (tensor where the architecture has it, else pipeline).",
        group="distributed",
    )

    @field_validator("max_loaded_models", "models_memory_bytes", "model_ttl")
    @classmethod
    def _models_non_negative(cls, v: Any) -> Any:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("speculative")
    @classmethod
    def _known_spec(cls, v: str | None) -> str | None:
        if v not in (None, "ngram", "draft", "off"):
            raise ValueError("must be ngram, draft or off")
        return None if v == "off" else v

    @field_validator("num_draft_tokens")
    @classmethod
    def _positive_drafts(cls, v: int) -> int:
        if not 1 <= v <= 64:
            raise ValueError("must be between 1 and 64")
        return v

    @field_validator("turbo_kv")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is None:
            return None
        from .turboquant.presets import parse_turbo

        parse_turbo(v)  # ValueError names the presets
        return None if v.strip().lower() in ("off", "none", "fp16") else v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype_ok(cls, v: str) -> str:
        v = str(v).strip().lower()
        if v not in ("auto", "fp8"):
            raise ValueError("must be auto or fp8")
        return v

    @field_validator("turbo_kv_window", "turbo_kv_threshold", "turbo_kv_keep_layers", "expert_top_k")
    @classmethod
    def _non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("max_images", "max_audio_clips", "max_image_pixels", "max_media_bytes", "max_audio_seconds")
    @classmethod
    def _positive_limit(cls, v: Any) -> Any:
        if v <= 0:
            raise ValueError("must be positive")
        return v

    @field_validator("distributed_sharding")
    @classmethod
    def _sharding_ok(cls, v: str) -> str:
        v = str(v).strip().lower()
        if v not in ("auto", "tensor", "pipeline"):
            raise ValueError("must be auto, tensor or pipeline")
        return v

    @field_validator("engine_process")
    @classmethod
    def _engine_process_ok(cls, v: str) -> str:
        v = str(v).strip().lower()
        if v not in ("auto", "on", "off"):
            raise ValueError("must be auto, on or off")
        return v

    @field_validator("expert_read_mode")
    @classmethod
    def _known_read_mode(cls, v: str) -> str:
        if v not in ("pread", "mmap"):
            raise ValueError("must be pread or mmap")
        return v

    @field_validator("expert_read_threads")
    @classmethod
    def _threads_ok(cls, v: int) -> int:
        if not 1 <= v <= 256:
            raise ValueError("must be between 1 and 256")
        return v

    @field_validator("mem_limit", "kv_cache_memory")
    @classmethod
    def _mem_limit_ok(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)
        return v

    @field_validator("turbo_kv_prompt_memory")
    @classmethod
    def _prompt_memory_ok(cls, v: str) -> str:
        if v not in ("auto", "off", "0"):
            parse_bytes(v)
        return v

    @field_validator("gpu_layers")
    @classmethod
    def _gpu_layers_ok(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("must be >= 0 (the number of layers kept on the GPU)")
        return v

    @field_validator("torch_dtype")
    @classmethod
    def _torch_dtype_ok(cls, v: str) -> str:
        if v not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError("must be auto, bfloat16, float16 or float32")
        return v

    @field_validator("quantize")
    @classmethod
    def _quantize_ok(cls, v: str | None) -> str | None:
        if v not in (None, "fp8"):
            raise ValueError("must be fp8")
        return v

    @field_validator("offload_dtype")
    @classmethod
    def _offload_dtype_ok(cls, v: str) -> str:
        if v not in ("float32", "bfloat16"):
            raise ValueError("must be float32 or bfloat16")
        return v

    @field_validator("device")
    @classmethod
    def _device_ok(cls, v: str | None) -> str | None:
        import re

        if v is not None and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", v):
            raise ValueError("must be cpu, cuda or cuda:N")
        return v

    @field_validator("tool_parser")
    @classmethod
    def _known_parser(cls, v: str) -> str:
        if v not in ("auto", "none", "hermes", "llama3", "mistral", "gemma"):
            raise ValueError("must be auto, none, hermes, llama3, mistral or gemma")
        return v

    # ---- ranges checked at start-up, so a bad default fails once with one sentence instead of every request
    @field_validator("temp")
    @classmethod
    def _temp_ok(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError("must be a number >= 0 (0 = greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p_ok(cls, v: float) -> float:
        if not math.isfinite(v) or not 0 < v <= 1:
            raise ValueError("must be in (0, 1]")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p_ok(cls, v: float) -> float:
        if not math.isfinite(v) or not 0 <= v <= 1:
            raise ValueError("must be in [0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k_ok(cls, v: int) -> int:
        if v < -1:
            raise ValueError("must be >= -1 (0 or -1 disable it)")
        return v

    @field_validator("api_workers")
    @classmethod
    def _api_workers_ok(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0 (0: auto)")
        return v

    @field_validator("repeat_penalty")
    @classmethod
    def _penalty_ok(cls, v: float) -> float:
        if not math.isfinite(v) or not 0.01 <= v <= 10:
            raise ValueError("must be in [0.01, 10]")
        return v

    @field_validator(
        "max_tokens", "repeat_last_n", "parallel", "prefill_size", "max_body_bytes", "data_parallel", "kv_block_size"
    )
    @classmethod
    def _at_least_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("adapter")
    @classmethod
    def _adapters_ok(cls, v: list[str]) -> list[str]:
        names = []
        for s in v:
            name, sep, path = str(s).partition("=")
            if not sep or not name.strip() or not path.strip() or ":" in name:
                raise ValueError(f"{s!r}: expected NAME=PATH (a name without ':' and an adapter directory)")
            if name.strip() in names:
                raise ValueError(f"adapter name {name.strip()!r} is used twice")
            names.append(name.strip())
        return v

    @field_validator("ctx_size")
    @classmethod
    def _ctx_ok(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be >= 1 (or left out: the model's own context length)")
        return v

    @field_validator("max_queue", "prompt_cache_bytes", "kv_budget_bytes", "max_batched_tokens")
    @classmethod
    def _zero_or_more(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("tensor_parallel", "pipeline_parallel", "nnodes")
    @classmethod
    def _ranks_ok(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 1024:
            raise ValueError("must be between 1 and 1024")
        return v

    @field_validator("node_rank")
    @classmethod
    def _node_rank_ok(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("port", "master_port")
    @classmethod
    def _port_ok(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError("must be a TCP port, 0 to 65535")
        return v

    @field_validator("served_model_name")
    @classmethod
    def _served_name_ok(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or v != v.strip()):
            raise ValueError("must be a non-empty name without leading or trailing spaces")
        return v

    @field_validator("log_level")
    @classmethod
    def _log_level_ok(cls, v: str) -> str:
        if v.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError("must be one of debug, info, warning, error, critical")
        return v

    def check_supported(self) -> None:
        why = kv_cache_dtype_conflict(self, self.backend)
        if why:
            raise ConfigError(why)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra or {}
            what = extra.get("not_built") if isinstance(extra, dict) else None
            if what and getattr(self, name) not in (None, False):
                raise NotSupportedYet(
                    f"--{name.replace('_', '-')}: {what} is not supported yet in this version of swiftlm"
                )


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """'8GB' -> 8e9, '512MiB' -> 512 * 2**20, '1000' -> 1000."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 8GB, 512MiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return n


def flag_of(name: str) -> str:
    extra = Settings.model_fields[name].json_schema_extra or {}
    return extra.get("flag") or "--" + name.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, groups: tuple[str, ...] | None = None) -> None:
    """Add one flag per setting (default SUPPRESS, so only flags given override env)."""
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra or {}
        if (groups is not None and extra.get("group") not in groups) or extra.get("no_flag"):
            continue
        kw: dict[str, Any] = {
            "dest": name,
            "default": argparse.SUPPRESS,
            "help": f"{field.description} [env SWIFTLM_{name.upper()}]",
        }
        ann = field.annotation
        if ann is bool:  # on-by-default switches also get --no-NAME
            kw["action"] = argparse.BooleanOptionalAction if field.default is True else "store_true"
        else:
            base = {int: int, float: float}.get(ann) or (
                int if ann == (int | None) else float if ann == (float | None) else str
            )
            kw["type"] = base
            kw["metavar"] = name.upper()
            if extra.get("nargs"):
                kw["nargs"] = extra["nargs"]
                kw["const"] = extra["const"]
            if extra.get("append"):
                kw["action"] = "append"
        opts = [flag_of(name), *extra.get("aliases", ())]
        opts.sort(key=lambda o: o.startswith("--"))  # short forms first, as llama-server's help shows them
        parser.add_argument(*opts, **kw)


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    if isinstance(given.get("model"), list):  # --model repeated
        models = given.pop("model")
        given["model"], given["extra_models"] = models[0], models[1:]
    return Settings(**given)


def kv_cache_dtype_conflict(cfg: Any, backend: str | None) -> str | None:
    """Why ``--kv-cache-dtype fp8`` does not combine with the other settings of ``cfg`` on ``backend`` (a
    name; None / "auto": not chosen yet), in one sentence naming the flags; None when it does."""
    if getattr(cfg, "kv_cache_dtype", "auto") != "fp8":
        return None
    if getattr(cfg, "turbo_kv", None) not in (None, False):
        return (
            "--kv-cache-dtype fp8 does not combine with --turbo-kv: TurboQuant (and a request's kv_bits) "
            "is a KV-cache format of its own; choose one"
        )
    if backend == "mlx":
        return "--kv-cache-dtype fp8 is built for the torch backend only (MLX: use --turbo-kv or a request's kv_bits)"
    for flag in ("tensor_parallel", "pipeline_parallel"):
        if int(getattr(cfg, flag, None) or 1) > 1:
            return f"--kv-cache-dtype fp8 does not combine with --{flag.replace('_', '-')} yet"
    return None
