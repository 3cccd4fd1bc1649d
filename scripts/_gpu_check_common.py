"""What the GPU check scripts (check_mixed_step.py, check_packed_prefill.py) share: the command line (``--model``,
the script's own options, ``--json``), the engine's torch model on CUDA, and the result rows, printed as they come
and written to ``--json`` at the end."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch


def parse_args(doc: str, *options: tuple[str, dict]) -> argparse.Namespace:
    """``--model`` (required), then each (flag, ``add_argument`` keywords) of ``options``, then ``--json``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    for flag, kw in options:
        ap.add_argument(flag, **kw)
    ap.add_argument("--json", default=None)
    return ap.parse_args()


class Check:
    """The model's engine (torch backend, no prompt cache) and the report: {"model", "device", ``fields``...,
    "rows"}."""

    def __init__(self, model: str, parallel: int, ctx_size: int, **fields: Any):
        from swiftlm import LLM

        self.llm = LLM(model, backend="torch", parallel=parallel, prompt_cache_bytes=0, ctx_size=ctx_size)
        self.tm = self.llm.engine.model
        self.out: dict = {"model": model, "device": torch.cuda.get_device_name(), **fields, "rows": []}

    def row(self, row: dict) -> None:
        print(row, flush=True)
        self.out["rows"].append(row)

    def finish(self, path: str | None) -> None:
        """Close the engine; write the report to ``path`` (--json) where one is given."""
        self.llm.close()
        if path:
            with open(path, "w") as f:
                json.dump(self.out, f, indent=1)


def run(main: Callable[[], None]) -> None:
    """The scripts' entry: the engine in this process (its model is what they inspect)."""
    os.environ.setdefault("SWIFTLM_ENGINE_PROCESS", "off")
    main()
