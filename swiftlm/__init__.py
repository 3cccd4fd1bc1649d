"""SwiftLM: a local LLM inference server with an OpenAI-compatible API.

``import swiftlm`` imports neither mlx nor torch; backends load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sampling import SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from .llm import LLM, AsyncLLM, RequestOutput


def __getattr__(name: str) -> Any:
    if name in ("LLM", "AsyncLLM", "RequestOutput", "CompletionOutput", "StreamDelta"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'swiftlm' has no attribute {name!r}")


__all__ = ["LLM", "AsyncLLM", "RequestOutput", "SamplingParams", "__version__"]
