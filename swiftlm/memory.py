"""Memory facts: what this process holds (measured), and the memory plan printed by
`swiftlm info` and `swiftlm --info` (computed from the checkpoint and the backend's dtypes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from functools import lru_cache
from typing import Any

from .registry import ModelSpec

MiB = 1 << 20


def system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


# --------------------------------------------------------------------------- measured: this process
def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon ... of /proc/<pid>/status in bytes (Linux); {} elsewhere."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key.startswith((b"Vm", b"Rss")) and rest.strip().endswith(b"kB"):
                    out[key.decode()] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


class _TimeValue(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_int), ("microseconds", ctypes.c_int)]


class _MachTaskBasicInfo(ctypes.Structure):
    _fields_ = [
        ("virtual_size", ctypes.c_uint64),
        ("resident_size", ctypes.c_uint64),
        ("resident_size_max", ctypes.c_uint64),
        ("user_time", _TimeValue),
        ("system_time", _TimeValue),
        ("policy", ctypes.c_int),
        ("suspend_count", ctypes.c_int),
    ]


@lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:  # pragma: no cover
        return None


def _mach_rss() -> tuple[int, int] | None:
    """macOS: (resident, peak resident) bytes of this task from task_info(MACH_TASK_BASIC_INFO)."""
    libc = _libc()
    try:
        task = ctypes.c_uint.in_dll(libc, "mach_task_self_")
        info = _MachTaskBasicInfo()
        count = ctypes.c_uint(ctypes.sizeof(info) // 4)
        if libc.task_info(task, 20, ctypes.byref(info), ctypes.byref(count)) != 0:  # 20: MACH_TASK_BASIC_INFO
            return None
        return int(info.resident_size), int(info.resident_size_max)
    except (AttributeError, ValueError, OSError):
        return None


def _maxrss() -> int:
    try:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):  # pragma: no cover - Windows
        return 0
    return int(r) if sys.platform == "darwin" else int(r) * 1024  # bytes on macOS, KiB on Linux


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def allocator_stats() -> dict[str, int]:
    """glibc malloc's own figures (mallinfo2): bytes in use by malloc'd blocks, bytes it holds
    free (in its arenas, not returned to the OS), and mmapped blocks.  {} without glibc >= 2.33."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {
        "in_use": int(m.uordblks) + int(m.hblkhd),
        "free": int(m.fordblks),
        "mmapped": int(m.hblkhd),
        "arena": int(m.arena),
    }


M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
DEFAULT_MMAP_THRESHOLD = 128 * 1024


def tune_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Pin glibc malloc's mmap threshold (mallopt(M_MMAP_THRESHOLD)).  By default glibc raises
    the threshold to the size of each large block freed (up to 32 MiB), after which the tensors
    and buffers of a server's steps -- activations, KV caches that grow, prompt-cache copies --
    come from the heap arenas and stay there when freed, so malloc holds free memory that grows
    with the load.  With the threshold pinned at 128 KiB large blocks are mmapped and returned to
    the OS on free.  The environment
    variable MALLOC_MMAP_THRESHOLD_ does the same from outside; when it is set this does nothing.
    False where there is no glibc."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    libc = _libc()
    fn = getattr(libc, "mallopt", None) if libc is not None and hasattr(libc, "mallinfo2") else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(fn(M_MMAP_THRESHOLD, int(mmap_threshold)))


def trim_allocator() -> bool:
    """Give glibc malloc's free memory back to the OS (malloc_trim(0)); False where there is none."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_size_t]
    return bool(fn(0))


def process_memory(pid: int | None = None) -> dict[str, int]:
    """Resident memory of a process, measured: ``rss`` now and ``peak_rss`` (high-water mark), in
    bytes.  Linux: /proc/<pid>/status (VmRSS, VmHWM); macOS (this process): task_info, else
    getrusage's ru_maxrss for the peak.  Zeros where nothing can be read."""
    st = _proc_status(pid if pid is not None else "self")
    if st:
        return {
            "rss": st.get("VmRSS", 0),
            "peak_rss": st.get("VmHWM", 0),
            "rss_anon": st.get("RssAnon", 0),
            "rss_file": st.get("RssFile", 0),
        }
    if pid is None or pid == os.getpid():
        mach = _mach_rss() if sys.platform == "darwin" else None
        if mach is not None:
            return {"rss": mach[0], "peak_rss": max(mach[1], _maxrss())}
        peak = _maxrss()
        return {"rss": peak, "peak_rss": peak}  # no current figure on this platform: the peak is the bound
    return {"rss": 0, "peak_rss": 0}


def host_memory() -> dict[str, Any]:
    """The CPU as a 'device' for /health: this process's resident memory is what it uses."""
    p = process_memory()
    cache = allocator_stats().get("free", 0)
    return {
        "device": "cpu",
        "architecture": "cpu",
        "device_name": cpu_name(),
        "active": p["rss"],
        "peak": p["peak_rss"],
        "cache": cache,
        "device_total": system_memory(),
    }


@lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    cfg = config.get("text_config") or config
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads))
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def streamable_layout(spec: ModelSpec) -> Any:
    """The checkpoint's ``ExpertLayout`` (from the safetensors headers), or a clear error when
    --stream-experts cannot apply (dense model, GGUF file, no expert tensors found)."""
    from .errors import UnsupportedArchitecture
    from .experts import scan_experts

    if spec.format == "gguf" or not spec.is_moe:
        raise UnsupportedArchitecture(
            f"--stream-experts needs an MoE model in safetensors; {spec.path} is "
            + ("a GGUF file" if spec.format == "gguf" else "not a mixture-of-experts model")
        )
    layout = scan_experts(spec.weight_files)
    if layout is None:
        raise UnsupportedArchitecture(f"--stream-experts: found no expert tensors in {spec.path}")
    return layout


def expert_plan(spec: ModelSpec, expert_top_k: int = 0) -> dict[str, Any]:
    """What --stream-experts keeps resident and reads: from the safetensors headers."""
    from .experts import clamp_top_k

    layout = streamable_layout(spec)
    k = spec.experts_per_token or 1
    used = clamp_top_k(expert_top_k, k)
    per_expert = layout.bytes_per_expert()
    return {
        "expert_layout": layout.style,
        "experts": layout.num_experts,
        "moe_layers": len(layout.layers),
        "experts_per_token": used,
        "model_experts_per_token": k,
        "resident_bytes": layout.resident_bytes,
        "expert_bytes": layout.expert_bytes_total,
        "bytes_per_expert": per_expert,
        "expert_bytes_per_token": layout.bytes_per_token(used),
        "read_buffer_bytes": used * per_expert,
    }


def device_kind(device: str) -> str:
    """'cuda', 'metal' or 'cpu' from a backend's Availability.device text."""
    d = (device or "").lower()
    return "cuda" if d.startswith("cuda") else "metal" if "metal" in d else "cpu"


_FLOAT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_INT_BYTES = {"U32": 4, "I32": 4, "U64": 8, "I64": 8, "U16": 2, "I16": 2}
_MLX_GGUF_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # what mx.load keeps quantized (group 32); the rest -> fp16


def held_weights(spec: ModelSpec, backend: str | None, device: str = "cpu") -> tuple[int, str]:
    """(bytes, how) of the weights a backend holds once loaded, from the checkpoint's headers:

    - torch: every tensor in the compute dtype (GGUF and 16-bit checkpoints are dequantized /
      upcast): parameters x 4 bytes on the CPU (fp32), x 2 on CUDA (bf16);
    - mlx: GGUF Q4_0/Q4_1/Q8_0 stay quantized (MLX affine, group 32, a scale and a bias per
      group), other GGUF types become fp16; quantized safetensors stay packed; on the CPU every
      floating tensor (scales included) is cast to fp32, on Metal the checkpoint's dtype is kept;
    - unknown backend: the bytes on disk."""
    if backend == "torch" and spec.num_params:
        nb = 2 if device == "cuda" else 4
        return spec.num_params * nb, f"{spec.quantization} -> {'bfloat16' if nb == 2 else 'float32'}"
    if backend == "mlx":
        cpu = device != "metal"
        try:
            if spec.format == "gguf":
                from .gguf_file import read_gguf_header

                _, tensors = read_gguf_header(spec.path)
                total = 0
                for t in tensors:
                    bits = _MLX_GGUF_BITS.get(t.type_name)
                    if bits:
                        total += t.n_elements * bits // 8 + (t.n_elements // 32) * 2 * (4 if cpu else 2)
                    else:
                        total += t.n_elements * (4 if cpu or t.type_name == "F32" else 2)
                return total, f"{spec.quantization} -> mlx" + (" (fp32 on the CPU)" if cpu else "")
            from .registry import _read_safetensors_header

            total = 0
            for f in spec.weight_files:
                for name, t in _read_safetensors_header(f).items():
                    if name == "__metadata__":
                        continue
                    n = 1
                    for d in t["shape"]:
                        n *= d
                    fb = _FLOAT_BYTES.get(t["dtype"])
                    total += n * ((4 if cpu else fb) if fb else _INT_BYTES.get(t["dtype"], 1))
            return total, f"{spec.quantization}" + (" (floats as fp32 on the CPU)" if cpu else "")
        except Exception:  # an unreadable header: fall back to the file size
            pass
    return spec.size_bytes, "as stored on disk"


def memory_plan(
    spec: ModelSpec,
    ctx_size: int | None = None,
    dtype_bytes: int | None = None,
    kv_format: Any = None,
    stream_experts: bool = False,
    expert_top_k: int = 0,
    backend: str | None = None,
    device: str = "cpu",
    parallel: int = 1,
    prompt_cache_bytes: int = 0,
    gpu_layers: int | None = None,
    offload_dtype: str = "float32",
) -> dict[str, Any]:
    """Weights as the backend will hold them (``held_weights``; the file size is given too), plus
    the KV cache of ``parallel`` sequences at full context in the backend's KV dtype: fp32 on the
    CPU (torch and MLX), 16-bit on CUDA and Metal (``dtype_bytes`` overrides).  On CUDA the torch
    backend preallocates one full-context slot per parallel sequence (plus a scratch row) at start,
    and caps the default context at 8192.  With ``kv_format`` a TurboQuant preset: the layout
    formula at that context (its dense rows are 16-bit).  With ``stream_experts`` the weights
    counted are the resident (non-expert) bytes plus one token's read buffers, and the expected
    expert bytes read per decoded token are given.  ``prompt_cache_bytes``: the prompt cache's cap,
    which it fills under load, counted in the total."""
    turbo = kv_format is not None and getattr(kv_format, "kind", "fp16") == "turbo"
    if dtype_bytes is None:
        dtype_bytes = 2 if turbo or device in ("cuda", "metal") else 4 if backend in ("torch", "mlx") else 2
    model_ctx = spec.context_length or ctx_size or 0
    if backend == "torch" and device == "cuda" and not ctx_size:
        model_ctx = min(model_ctx, 8192)  # backends/torch/runner.py CUDA_DEFAULT_CTX
    ctx = min(ctx_size or model_ctx, model_ctx)
    parallel = max(1, int(parallel or 1))
    seqs = parallel + 1 if backend == "torch" and device == "cuda" else parallel
    per_tok = kv_bytes_per_token(spec.config, dtype_bytes)
    weights, how = held_weights(spec, backend, device)
    plan: dict[str, Any] = {
        "backend": backend,
        "device": device,
        "weights_bytes": weights,
        "weights_held_as": how,
        "weights_file_bytes": spec.size_bytes,
        "context_tokens": ctx,
        "parallel": parallel,
        "kv_element_size": dtype_bytes,
        "kv_bytes_per_token": per_tok,
        "kv_cache_bytes_per_sequence": per_tok * ctx,
        "kv_cache_bytes": per_tok * ctx * seqs,
        "kv_preallocated": backend == "torch" and device == "cuda",
    }
    if turbo and ctx:
        from .turboquant.presets import COMPRESS_BLOCK, turbo_layout_bytes

        cfg = spec.config.get("text_config") or spec.config
        heads = int(cfg.get("num_attention_heads") or 1)
        n_dense = min(ctx, kv_format.window + COMPRESS_BLOCK - 1)
        f = turbo_layout_bytes(
            kv_format,
            n_code=ctx - n_dense,
            n_dense=n_dense,
            layers=int(cfg.get("num_hidden_layers") or 0),
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads)),
        )
        plan["kv_format"] = kv_format.name
        plan["kv_cache_16bit_bytes"] = plan["kv_cache_bytes"]
        plan["kv_cache_bytes_per_sequence"] = f["codes_allocated"] + f["dense_allocated"] + f["uncompressed_layers"]
        plan["kv_cache_bytes"] = plan["kv_cache_bytes_per_sequence"] * seqs
    if stream_experts:
        ex = expert_plan(spec, expert_top_k)
        plan.update({f"stream_{k}": v for k, v in ex.items()})
        plan["weights_bytes"] = ex["resident_bytes"] + ex["read_buffer_bytes"]
    layers = int((spec.config.get("text_config") or spec.config).get("num_hidden_layers") or 0)
    if backend == "torch" and gpu_layers is not None and gpu_layers < layers:
        plan.update(
            offload_plan(
                spec,
                gpu_layers,
                layers,
                plan,
                2 if device == "cuda" else 4,
                4 if offload_dtype == "float32" else 2,
                parallel,
            )
        )
    plan["prompt_cache_bytes"] = int(prompt_cache_bytes or 0)  # the prompt cache's cap (--prompt-cache-bytes)
    plan["total_bytes"] = plan["weights_bytes"] + plan["kv_cache_bytes"] + plan["prompt_cache_bytes"]
    plan["system_memory_bytes"] = system_memory()
    plan["fits"] = plan["total_bytes"] < plan["system_memory_bytes"] * 0.8 if plan["system_memory_bytes"] else None
    return plan


def layer_elements(spec: ModelSpec) -> tuple[int, list[int]]:
    """(elements outside the transformer layers: embedding, final norm, head; elements of each
    layer), from the checkpoint's headers (safetensors ``layers.N.``, GGUF ``blk.N.``)."""
    import re

    cfg = spec.config.get("text_config") or spec.config
    per = [0] * int(cfg.get("num_hidden_layers") or 0)
    outside = 0
    pat = re.compile(r"(?:^|\.)(?:layers|blk)\.([0-9]+)\.")

    def add(name: str, n: int) -> None:
        nonlocal outside
        m = pat.search(name)
        if m and int(m.group(1)) < len(per):
            per[int(m.group(1))] += n
        else:
            outside += n

    if spec.format == "gguf":
        from .gguf_file import read_gguf_header

        for t in read_gguf_header(spec.path)[1]:
            add(t.name, t.n_elements)
    else:
        from .registry import _read_safetensors_header

        for f in spec.weight_files:
            for name, t in _read_safetensors_header(f).items():
                if name != "__metadata__":
                    n = 1
                    for d in t["shape"]:
                        n *= d
                    add(name, n)
    return outside, per


def offload_plan(
    spec: ModelSpec, gpu_layers: int, layers: int, plan: dict[str, Any], main_bytes: int, off_bytes: int, parallel: int
) -> dict[str, Any]:
    """The split of ``--gpu-layers``: layers [0, N), the embedding, the final norm and the head on
    the device in its dtype; layers [N, L) and their KV rows on the CPU in --offload-dtype.  KV is
    counted for ``parallel`` sequences at full context (no preallocated slot pool when offloaded)."""
    outside, per = layer_elements(spec)
    kv_layer = plan["kv_bytes_per_token"] // max(1, layers) // max(1, plan["kv_element_size"])  # elements
    ctx, seqs = plan["context_tokens"], max(1, parallel)
    dev_w = (outside + sum(per[:gpu_layers])) * main_bytes
    cpu_w = sum(per[gpu_layers:]) * off_bytes
    dev_kv = kv_layer * gpu_layers * main_bytes * ctx * seqs
    cpu_kv = kv_layer * (layers - gpu_layers) * off_bytes * ctx * seqs
    return {
        "gpu_layers": gpu_layers,
        "cpu_layers": layers - gpu_layers,
        "offload_dtype": "float32" if off_bytes == 4 else "bfloat16",
        "device_weights_bytes": dev_w,
        "cpu_weights_bytes": cpu_w,
        "device_kv_cache_bytes": dev_kv,
        "cpu_kv_cache_bytes": cpu_kv,
        "device_bytes": dev_w + dev_kv,
        "cpu_bytes": cpu_w + cpu_kv,
        "weights_bytes": dev_w + cpu_w,
        "kv_cache_bytes": dev_kv + cpu_kv,
        "kv_cache_bytes_per_sequence": (dev_kv + cpu_kv) // seqs,
        "kv_bytes_per_token": kv_layer * (gpu_layers * main_bytes + (layers - gpu_layers) * off_bytes),
        "kv_preallocated": False,
    }


def plan_for(spec: ModelSpec, settings: Any, backends: Any = None) -> dict[str, Any]:
    """``memory_plan`` for the backend ``settings`` would choose on this machine (none usable: the
    file sizes and 16-bit KV)."""
    from .backend import choose_backend, discover_backends
    from .errors import SwiftLMError
    from .turboquant.presets import settings_format

    name, device = None, "cpu"
    try:
        chosen, _ = choose_backend(settings.backend, backends)
        name = chosen.name
        entries = backends if backends is not None else discover_backends([name])
        entry = entries.get(name)
        device = device_kind(entry.availability.device if entry is not None else "")
    except SwiftLMError:
        pass
    fp8 = getattr(settings, "kv_cache_dtype", "auto") == "fp8"  # --kv-cache-dtype fp8: 1 byte per element
    plan = memory_plan(
        spec,
        settings.ctx_size,
        dtype_bytes=1 if fp8 else None,
        kv_format=settings_format(settings),
        stream_experts=settings.stream_experts,
        expert_top_k=settings.expert_top_k,
        backend=name,
        device=device,
        parallel=getattr(settings, "parallel", 1),
        prompt_cache_bytes=getattr(settings, "prompt_cache_bytes", 0),
        gpu_layers=getattr(settings, "gpu_layers", None),
        offload_dtype=getattr(settings, "offload_dtype", "float32"),
    )
    plan["kv_cache_dtype"] = "fp8 (e4m3)" if fp8 else "auto (the model's dtype)"
    return plan
