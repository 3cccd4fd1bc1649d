"""Benchmark tools.

``swiftlm bench serve`` (``serve.py``): a load generator for any OpenAI-compatible server (SwiftLM, vLLM,
llama-server, mlx_lm.server, ``transformers serve``): streamed requests at a fixed concurrency or a Poisson
request rate; time to first token, inter-token latency, end-to-end latency and throughput.

Nothing here imports mlx or torch; ``httpx`` is imported only when a benchmark runs.
"""
