"""The order in which the whole suite's files are handed to the xdist workers: the longest first.

scripts/test.sh runs two workers with ``--dist loadfile --no-loadscope-reorder``: every file goes whole to one worker
(its module-scoped servers and models are shared), the next file to whichever worker runs low first, in collection
order.  Handing out the longest files first and the short ones last lets both workers end within a few seconds of each
other (longest-processing-time first).  xdist's own order (most tests first) put files of one or two long tests last
(test_soak, test_code_pages, test_reference_torch, test_tq_paged): one worker ran them alone for the last ~25-60 s.

SECONDS is each file's time in a whole run from a fresh clone on the 2-core CI machine (junit times, setup + call +
teardown, summed per file; files of 10 s or more in that run), test_kv_compressed.py's less what its numba cut saved
since, and the files of interpreted Triton kernels scaled by what skipping the self-check and the interpreter's
redundant patching saved (tests/conftest.py: their tests alone took 0.6-0.8 of their earlier time).  The entries of
test_install, test_server, test_ray_serve, test_speculative, test_reference_torch, test_mlx_distributed,
test_code_pages, test_fork and test_shutdown are from a later whole run from a fresh clone (2026-11-30, with the
changes that shortened them and scripts/test.sh writing bytecode), the others from the earlier run.  A fresh clone
pays first-use costs in the file that meets them first (numba compiles its CPU attention kernels once per shape and
format, ~4 s each; the checkpoint cache fills).  A file not listed counts 0.21 s per test (the mean of the unlisted
ones).  The figures only order the files: a stale or missing entry changes no test, only when its file
starts.  Replaying that run's per-file times through two workers: this order ends both within 1 s of each other,
alphabetical order 17 s apart, xdist's most-tests-first 3 s (with 125 files the short ones fill the gaps either way;
what the order guards against is a long file handed out last).
"""

from __future__ import annotations

UNLISTED_PER_TEST = 0.21

SECONDS = {
    "test_install.py": 223,
    "test_cuda_ext.py": 158,
    "test_server.py": 147,
    "test_ray_serve.py": 137,
    "test_speculative.py": 133,
    "test_kv_compressed.py": 101,
    "test_reference_torch.py": 67,
    "test_tensor_parallel.py": 64,
    "test_mlx_distributed.py": 59,
    "test_cli_convert.py": 57,
    "test_engine_process.py": 47,
    "test_lora_mlx.py": 46,
    "test_pipeline_parallel.py": 46,
    "test_compressed_batch.py": 41,
    "test_code_pages.py": 40,
    "test_fork.py": 39,
    "test_batching.py": 37,
    "test_quant_formats.py": 36,
    "test_cli_first_contact.py": 36,
    "test_prefix_cache.py": 29,
    "test_window_kv_bounded.py": 29,
    "test_bench_matrix.py": 28,
    "test_multimodal.py": 26,
    "test_soak.py": 24,
    "test_gguf_torch_archs.py": 24,
    "test_hub.py": 22,
    "test_health_metrics.py": 22,
    "test_cpu_kernels.py": 22,
    "test_code_pages_engine.py": 20,
    "test_multi_model.py": 19,
    "test_expert_streaming.py": 19,
    "test_torch_archs.py": 19,
    "test_paged_kv.py": 19,
    "test_torch_archs_moe.py": 19,
    "test_torch_backend.py": 18,
    "test_api_workers.py": 18,
    "test_mlx_kvbits_cpu_kernel.py": 17,
    "test_test_time.py": 17,
    "test_webui.py": 17,
    "test_responses_api.py": 16,
    "test_engine_exact.py": 16,
    "test_anthropic_api.py": 16,
    "test_bench_serve.py": 15,
    "test_tq_paged.py": 13,
    "test_structured.py": 13,
    "test_ollama_api.py": 13,
    "test_data_parallel.py": 12,
    "test_paged_attention.py": 11,
    "test_lora.py": 11,
    "test_registry.py": 11,
    "test_shutdown.py": 10,
    "test_fused_decode.py": 9,
}


def longest_first(items: list) -> list:
    """``items`` with whole files in decreasing estimated time (stable: collection order within a file and among
    equal estimates)."""
    per_file: dict[str, int] = {}
    for item in items:
        per_file[item.path.name] = per_file.get(item.path.name, 0) + 1

    def cost(item) -> float:
        name = item.path.name
        return SECONDS.get(name, UNLISTED_PER_TEST * per_file[name])

    return sorted(items, key=lambda item: -cost(item))
