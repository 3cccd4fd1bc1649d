"""``relayout``: another KV layout for an idle CPU engine's torch model (``runner.TorchModel``), set after it was
built (the CUDA layout on this CPU: fixed caches, a paged pool, eager graphs).  The model's parts (``seqs``,
``prefix``, ``kv``, ``packed``) are built from its fields on first use, so they are built again from the new ones."""

from typing import Any

PARTS = ("seqs", "prefix", "kv", "packed")
ATTACHED = ("kv_blocks", "code_blocks", "stage_budget", "code_pages")  # set on the caches part after it was built


def relayout(m: Any, context: int | None = None, **fields: Any) -> None:
    """Set ``fields`` (``static``, ``pool``, ``graphs``) on ``m`` and ``context`` as its context length; what was
    attached to its caches part (block managers, the stage budget, code pages) carries over."""
    old = m.__dict__.get("seqs")
    if context is not None:
        m.info.context_length = context
    for k, v in fields.items():
        setattr(m, k, v)
    for p in PARTS:
        m.__dict__.pop(p, None)
    for k in ATTACHED if old is not None else ():
        if k in old.__dict__:
            setattr(m.seqs, k, getattr(old, k))
