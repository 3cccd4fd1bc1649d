"""``kv_bits`` decode attention on MLX's CPU device through the numba kernel.

A ``kv_bits`` sequence on the MLX backend holds mlx-lm's ``QuantizedKVCache`` (``model._make_cache``), whose attention
(``mlx_lm.models.base.quantized_scaled_dot_product_attention``: two ``mx.quantized_matmul`` calls and a softmax)
is slower than the plain fp32 cache on the CPU at long contexts.  Its storage is the affine layout of the numba
kernel ``swiftlm.turboquant.cpu_attention.affine_kernel``, which the torch backend's ``kv_bits`` caches use:
``mx.quantize`` packs codes into uint32 words little-end first (8 bits: byte d of a row is code d; 4 bits: byte k
holds code 2k in its low nibble and 2k + 1 in its high one), so on a little-endian host the code buffers
[B, KVH, cap, D * bits / 32] read as bytes are the kernel's [KVH, cap, D * bits / 8]; scales and biases are
[B, KVH, cap, D / group] and a value is ``code * scale + bias``, as in the kernel.

``turbo_cache.install_attention_hook`` wraps the model module's ``scaled_dot_product_attention``; for a
``QuantizedKVCache`` it asks ``routes`` and, for a single decode row of one sequence on the CPU device (numba
present, ``SWIFTLM_NUMBA`` not "0"), answers with ``attend``: the cache's buffers are evaluated and handed to
the kernel as numpy views (no copy of the codes; scales and biases are copied to fp32 only when the cache is
not fp32), the kernel's per-span partials are merged in numpy.  Prefill and verify chunks, batched caches,
masks other than causal, attention sinks and Metal keep mlx-lm's path.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache


def routes(cache: Any, queries: mx.array, mask: Any, sinks: Any = None) -> bool:
    """Whether this attention call goes through the numba kernel (see the module doc)."""
    if not isinstance(cache, QuantizedKVCache) or sinks is not None:
        return False
    B, H, T, D = queries.shape
    if B != 1 or T != 1 or (mask is not None and not isinstance(mask, str)):  # "causal" masks nothing for one row
        return False
    keys, values = cache.keys, cache.values
    if not (isinstance(keys, (tuple, list)) and isinstance(values, (tuple, list)) and len(keys) == len(values) == 3):
        return False
    bits, group = cache.bits, cache.group_size
    KVH = keys[0].shape[1]
    if bits not in (4, 8) or not group or D % group or H % KVH or sys.byteorder != "little":
        return False
    if keys[0].shape[-1] * 32 // bits != D or values[0].shape[-1] * 32 // bits != D:
        return False
    if not 0 < cache.offset <= keys[0].shape[2]:
        return False
    if mx.default_device().type != mx.DeviceType.cpu:
        return False
    from swiftlm.turboquant import cpu_attention

    return cpu_attention.enabled()


def _np(a: mx.array) -> np.ndarray:
    """An evaluated MLX array as numpy: a view of its buffer (no copy) where it is C-contiguous."""
    x = np.asarray(a)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def attend(cache: Any, queries: mx.array, scale: float) -> mx.array:
    """queries [1, H, 1, D] (rope applied) over the cache's ``offset`` rows -> [1, H, 1, D] in the queries' dtype."""
    from swiftlm.turboquant import cpu_attention

    _, H, _, D = queries.shape
    n, bits, group = cache.offset, cache.bits, cache.group_size
    kq, ks, kb = cache.keys
    vq, vs, vb = cache.values
    KVH = kq.shape[1]
    q = queries.astype(mx.float32).reshape(KVH, H // KVH, D) * scale
    # the fp32 scales / biases: the buffers themselves, else fp32 copies of their first n rows
    side = [x if x.dtype == mx.float32 else x[..., :n, :].astype(mx.float32) for x in (ks, kb, vs, vb)]
    mx.eval(q, kq, vq, *side)  # this step's row written into the buffers, the query: computed before they are read
    kp, vp = (_np(x).view(np.uint8)[0] for x in (kq, vq))
    ksn, kbn, vsn, vbn = (_np(x)[0] for x in side)
    spans = cpu_attention.affine_spans(_np(q), kp, ksn, kbn, vp, vsn, vbn, n, bits, group)
    _, l, acc = cpu_attention.merge_spans(*spans)
    return mx.array((acc / l).reshape(1, H, 1, D)).astype(queries.dtype)


def prepare(module: Any, head_dim: int, bits: int, group: int) -> None:
    """For a model that gets ``kv_bits`` caches on the CPU device (its caller installs the attention hook,
    ``turbo_cache.install_attention_hook``): this shape's kernel compiled (or loaded from numba's disk cache) in
    the background."""
    from swiftlm.turboquant import cpu_attention

    args = getattr(module, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads and heads % kv_heads == 0:
        cpu_attention.warm_up_affine(head_dim, heads // kv_heads, bits, group)
