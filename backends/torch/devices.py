"""Where the torch backend runs and how much memory it takes there: the device and dtype (--device,
--torch-dtype), the CUDA memory cap (--mem-limit), the paged KV pool's size (--kv-block-size,
--kv-cache-memory), the caching allocator's figures, and why a model runs eagerly on CUDA."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

CUDA_DEFAULT_CTX = 8192


def cuda_eager_reason(a: Any, device: torch.device, ctx: int) -> str | None:
    """Why a model on ``device`` runs on the eager (dynamic) path there, or None: on the CPU always
    eager (None: nothing to say); on CUDA the static path (slot pool, CUDA graphs, packed prefill, paged
    attention, overlapped steps) unless --gpu-layers keeps layers on the CPU, or the layer is not the
    llama-family one / a sliding window shorter than the served context ``ctx`` applies
    (``model_config.Args.eager_reason``)."""
    if device.type != "cuda":
        return None
    if a.offload is not None:
        return "--gpu-layers keeps layers on the CPU"
    return a.eager_reason(ctx)


def device_memory(device: torch.device) -> dict[str, Any]:
    """The CUDA caching allocator's figures (active = allocated, peak = max allocated, cache =
    reserved but unallocated), or on the CPU this process's resident memory and malloc's free bytes."""
    from swiftlm.memory import host_memory

    if device.type != "cuda":
        return host_memory()
    index = device.index if device.index is not None else torch.cuda.current_device()
    alloc, reserved = torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index)
    props = torch.cuda.get_device_properties(index)
    return {
        "device": "cuda",
        "architecture": props.name,
        "device_name": props.name,
        "active": alloc,
        "peak": torch.cuda.max_memory_allocated(index),
        "cache": reserved - alloc,
        "reserved": reserved,
        "device_total": props.total_memory,
    }


def bind_thread(device: torch.device) -> None:
    """A model on cuda:N (--device, --data-parallel) makes N the calling thread's current device:
    graph capture, Triton launches and new streams follow the current device, not the tensors."""
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device.index)


def pick_device(cfg: Any) -> tuple[torch.device, torch.dtype]:
    """--device (default: cuda when available) and the compute dtype there: --torch-dtype on a GPU
    (auto: bfloat16), float32 on the CPU."""
    want = getattr(cfg, "device", None) if cfg is not None else None
    name = getattr(cfg, "torch_dtype", "auto") if cfg is not None else "auto"
    gpu_dtype = {
        "auto": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
    }.get(name if isinstance(name, str) else "auto", torch.bfloat16)
    if want:  # --device (one sentence if it does not exist here)
        dev = torch.device(want)
        if dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (dev.index or 0) >= n:
                from swiftlm.errors import ConfigError

                raise ConfigError(f"--device {want}: this machine has {n} CUDA device(s)")
            return dev, gpu_dtype
        return dev, torch.float32
    if torch.cuda.is_available():
        return torch.device("cuda"), gpu_dtype
    return torch.device("cpu"), torch.float32


KV_FREE_FRACTION = 0.9  # of the device memory free after loading: the default KV pool's cap
STAGE_BYTES = 4 << 30  # staging room of compressed prompts on CUDA (--turbo-kv-prompt-memory auto), at least
STAGE_FREE_FRACTION = 0.35  # of the device memory free after loading: the most auto staging takes


def stage_bytes(cfg: Any, a: Any, device: torch.device, ctx: int, dtype: torch.dtype) -> int:
    """Bytes in which prompts of compressed KV caches are held in 16 bits while they prefill (``StageBudget``),
    from --turbo-kv-prompt-memory.  ``auto``: off on CPUs; on CUDA STAGE_BYTES, or, when the server's default
    format is compressed, one whole context's 16-bit rows if that is more (a prompt as long as the context then
    prefills at the 16-bit speed), capped at STAGE_FREE_FRACTION of the memory free now.  The default pools
    leave it free (``code_pool_pages``' ``taken``)."""
    from swiftlm.config import parse_bytes
    from swiftlm.turboquant.presets import settings_format

    setting = str(getattr(cfg, "turbo_kv_prompt_memory", None) or "auto")
    if setting != "auto":
        return 0 if setting in ("off", "0") else parse_bytes(setting)
    if device.type != "cuda":
        return 0
    want = STAGE_BYTES
    if settings_format(cfg).compressed:
        row = 2 * a.layers * a.kv_heads * a.head_dim * torch.finfo(dtype).bits // 8
        want = max(want, ctx * row)
    free, _ = torch.cuda.mem_get_info(device)
    limit = min(want, int(free * STAGE_FREE_FRACTION))
    log.info("prompt staging for compressed KV caches: %.2f GiB (--turbo-kv-prompt-memory)", limit / 2**30)
    return limit


def kv_pool_size(cfg: Any, a: Any, device: torch.device, dtype: torch.dtype, slots: int, ctx: int) -> tuple[int, int]:
    """(block size, blocks) of the paged KV pool: --kv-block-size positions per block; --kv-cache-memory
    bytes of blocks, else room for every --parallel sequence at full context, capped at KV_FREE_FRACTION of
    the device memory free now; never less than one full context.  With a compressed server-wide format
    (--turbo-kv) the requests that use the pool are those that turn compression off: the pool is then one
    full context (the compressed sequences' codes are pages of a pool of their own, ``code_pool_pages``, whose
    size --kv-cache-memory then sets; with --turbo-kv-keep-layers each keeps a cache of its own)."""
    from swiftlm.turboquant.presets import settings_format

    bs = max(1, min(int(getattr(cfg, "kv_block_size", 64) or 64), ctx))
    per_block = 2 * a.layers * a.kv_heads * a.head_dim * bs * torch.finfo(dtype).bits // 8
    per_seq = -(-ctx // bs)
    want = getattr(cfg, "kv_cache_memory", None)
    fmt = settings_format(cfg)
    if fmt.kind == "turbo" and not fmt.keep_layers:  # --kv-cache-memory sizes the code pages (code_pool_pages)
        n = per_seq
        log.info(
            "KV pool: --turbo-kv %s is the default format, so the 16-bit pool holds one %d-token context "
            '(requests with turbo_kv "off")',
            fmt.name,
            ctx,
        )
    elif fmt.compressed and not want:
        n = per_seq
        log.info(
            "KV pool: --turbo-kv is the default format, so the 16-bit pool holds one %d-token context "
            '(requests with turbo_kv "off"); --kv-cache-memory sets it',
            ctx,
        )
    else:
        return bs, _pool_units("KV pool", "blocks", per_block, bs, slots, ctx, want, device)
    log.info("KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB)", n, bs, n * bs, n * per_block / 2**30)
    return bs, n


def _pool_units(
    what: str,
    units: str,
    unit_bytes: int,
    unit_tokens: int,
    slots: int,
    ctx: int,
    want: str | None,
    device: torch.device,
    taken: int = 0,
) -> int:
    """Units (blocks, pages) of ``unit_bytes`` holding ``unit_tokens`` positions each for a preallocated pool:
    ``want`` bytes (--kv-cache-memory), or room for every --parallel sequence at full context capped at
    KV_FREE_FRACTION of the device memory free now less ``taken`` bytes; never less than one full context."""
    from swiftlm.config import parse_bytes

    per_seq = -(-ctx // unit_tokens)
    if want:
        n = parse_bytes(want) // unit_bytes
    else:
        n = slots * per_seq
        free, _ = torch.cuda.mem_get_info(device)
        cap = max(0, int(free * KV_FREE_FRACTION) - taken) // unit_bytes
        if n > cap:
            log.warning(
                "%s: %d sequences at %d tokens need %.1f GiB; using %.1f GiB (%d tokens): sequences are "
                "preempted when they outgrow it (--kv-cache-memory sets it)",
                what,
                slots,
                ctx,
                n * unit_bytes / 2**30,
                cap * unit_bytes / 2**30,
                cap * unit_tokens,
            )
            n = cap
    if n < per_seq:
        log.warning("%s: %d %s hold less than one %d-token context; raised to %d", what, n, units, ctx, per_seq)
        n = per_seq
    log.info(
        "%s: %d %s of %d tokens (%d tokens, %.2f GiB)",
        what,
        n,
        units,
        unit_tokens,
        n * unit_tokens,
        n * unit_bytes / 2**30,
    )
    return n


def _apply_mem_limit(cfg: Any, device: torch.device) -> None:
    """--mem-limit on CUDA: the caching allocator refuses to grow past it (OOM instead)."""
    limit = getattr(cfg, "mem_limit", None)
    if not limit:
        return
    from swiftlm.config import parse_bytes

    if device.type != "cuda":
        log.warning("--mem-limit applies to CUDA memory; ignored on %s", device.type)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(limit) / total), index)
    log.info("CUDA memory capped at %s bytes (%.3f of %s)", parse_bytes(limit), parse_bytes(limit) / total, total)


def code_pool_pages(cfg: Any, a: Any, device: torch.device, slots: int, ctx: int, taken: int = 0) -> int:
    """Pages of the TurboQuant code pool (``code_pages.py``) when --turbo-kv's format is the server default
    (every layer compressed), else 0: --kv-cache-memory bytes of pages, or by default room for every --parallel
    sequence at full context, capped at KV_FREE_FRACTION of the device memory free now less ``taken`` bytes
    (the 16-bit pool, not yet allocated); never less than one full context."""
    from swiftlm.turboquant.presets import settings_format

    from .code_pages import PAGE_ROWS, CodePages

    fmt = settings_format(cfg)
    if fmt.kind != "turbo" or fmt.keep_layers:
        return 0
    if os.environ.get("SWIFTLM_CODE_PAGES", "1") == "0":  # A/B runs: whole-context codes per sequence, as before
        log.info("TurboQuant code pages off (SWIFTLM_CODE_PAGES=0): each sequence's cache holds a whole context")
        return 0
    return _pool_units(
        f"TurboQuant code pages ({fmt.name})",
        "pages",
        CodePages.page_bytes_for(a, fmt),
        PAGE_ROWS,
        slots,
        ctx,
        getattr(cfg, "kv_cache_memory", None),
        device,
        taken,
    )
