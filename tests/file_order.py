"""The order in which the whole suite's files are handed to the xdist workers: the longest first.

scripts/test.sh runs two workers with ``--dist loadfile --no-loadscope-reorder``: every file goes whole to one worker
(its module-scoped servers and models are shared), the next file to whichever worker runs low first, in collection
order.  Handing out the longest files first and the short ones last lets both workers end within a few seconds of each
other (longest-processing-time first).  xdist's own order (most tests first) put files of one or two long tests last
(test_soak, test_code_pages, test_reference_torch, test_tq_paged): one worker ran them alone for the last ~25-60 s.

SECONDS is each file's time in a whole run on the 2-core CI machine (``--durations=0``, summed per file; files of
10 s or more).  A file not listed counts 0.16 s per test (the mean of the unlisted ones).  The figures only order the
files: a stale or missing entry changes no test, only when its file starts.
"""

from __future__ import annotations

UNLISTED_PER_TEST = 0.16

SECONDS = {
    "test_install.py": 155,
    "test_ray_serve.py": 129,
    "test_speculative.py": 127,
    "test_cuda_ext.py": 93,
    "test_server.py": 82,
    "test_mlx_distributed.py": 67,
    "test_reference_torch.py": 66,
    "test_code_pages.py": 66,
    "test_compressed_batch.py": 57,
    "test_fork.py": 55,
    "test_batching.py": 54,
    "test_tensor_parallel.py": 54,
    "test_engine_process.py": 45,
    "test_cli_convert.py": 43,
    "test_pipeline_parallel.py": 37,
    "test_quant_formats.py": 30,
    "test_window_kv_bounded.py": 30,
    "test_cli_first_contact.py": 29,
    "test_lora_mlx.py": 28,
    "test_prefix_cache.py": 27,
    "test_gguf_torch_archs.py": 25,
    "test_soak.py": 23,
    "test_test_time.py": 23,
    "test_hub.py": 22,
    "test_multi_model.py": 21,
    "test_multimodal.py": 19,
    "test_bench_matrix.py": 19,
    "test_registry.py": 19,
    "test_api_workers.py": 18,
    "test_health_metrics.py": 18,
    "test_tq_paged.py": 18,
    "test_torch_backend.py": 18,
    "test_kv_compressed.py": 18,
    "test_paged_kv.py": 18,
    "test_expert_streaming.py": 17,
    "test_shutdown.py": 17,
    "test_json_close.py": 17,
    "test_fused_decode.py": 17,
    "test_bench_serve.py": 16,
    "test_webui.py": 15,
    "test_torch_archs.py": 15,
    "test_structured.py": 15,
    "test_paged_attention.py": 15,
    "test_anthropic_api.py": 14,
    "test_responses_api.py": 14,
    "test_engine_exact.py": 14,
    "test_ollama_api.py": 13,
    "test_torch_archs_moe.py": 13,
    "test_code_pages_engine.py": 11,
    "test_lora.py": 11,
    "test_sample_kernel.py": 10,
    "test_auth_tls.py": 10,
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
