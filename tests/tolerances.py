"""Tolerances for comparing two floating-point computations of the same math, derived from the
rounding error of the reductions involved instead of a constant one machine's BLAS happens to meet.

Why a derived bound.  Two code paths for the same math (eager vs fixed-shape decode, batched vs
one row, torch vs MLX, a kernel vs its reference) sum the same products in different orders:
BLAS kernels block the reduction dimension differently per CPU (AVX2 vs AVX-512 register
tiles, MKL vs OpenBLAS, GEMV for one row vs GEMM for several, FMA or not, the thread count),
so the last bits of every output depend on where the tests run.  A fixed ``atol=1e-5`` on
logits of magnitude ~34 is ~2.5 ulp of relative error: one CPU meets it, the next one need not
(with the argmax still equal).

The bound.  Summing K products in floating point (unit roundoff u = eps/2) gives, to first
order, an error  E = sum_j delta_j * s_j  with |delta_j| <= u and s_j the partial sums.
Modelling the delta_j as independent and mean-zero (Higham & Mary, "A new approach to
probabilistic rounding error analysis", SISC 2019), Hoeffding's inequality gives
    P(|E| >= lam * u * sqrt(sum_j s_j^2)) <= 2 exp(-lam^2 / 2),
and sum_j s_j^2 <= K * max_j |s_j|^2, where the partial sums of incoherent terms stay within
the scale M of the results (they grow like sqrt(j)).  So one summation order is within
lam * u * sqrt(K) * M of the exact value and two orders are within lam * eps * sqrt(K) * M of
each other: the error grows like sqrt(K) (a random walk).  The deterministic worst case,
K * u * sum|a||b| (~K^1.5 * u * M for incoherent terms), is not used: never approached in
practice, and over a transformer's chained reductions it reaches ~1e-1 on the tiny test
model's logits, the size of a real bug.

Chained reductions (the layers of a transformer) each add such a rounding walk; RMSNorm and
the residual stream pass a relative error on with a gain of about one, so ``layers`` chained
reductions of length <= K behave like one walk of K * layers steps: the bound becomes
lam * eps * sqrt(K * layers) * M.

The constant: lam = 8.  A test compares up to ~1e6 numbers (a few rows of a 49k vocabulary
over several steps); with the union bound, 1e6 * 2 exp(-lam^2 / 2) = 2.5e-8 at lam = 8, so a
correct implementation is not expected to fail on any CPU, and the headroom covers the modest
gain of softmax and gated MLPs over the idealised model.  For the tiny test transformer
(K = 256, 13 chained reductions, logits up to ~35-40) this is ~2e-3, well above the differences
two machines give, while a real bug (rope
one position off, the newest row masked out) moves these logits by 4 to 13: tests that use the
bound also check that such a bug exceeds it by orders of magnitude, so the tolerance cannot
silently hide one.
"""

from __future__ import annotations

import math
from typing import Any

FP32_EPS = 2.0**-23  # float32 machine epsilon (numpy.finfo(float32).eps); unit roundoff u = eps / 2
FP64_EPS = 2.0**-52
LAMBDA = 8.0  # standard deviations of the rounding walk: see the module docstring

# chained reductions in one transformer block: QKV projection, Q.K^T, P.V, output projection,
# gate/up projection, down projection
REDUCTIONS_PER_BLOCK = 6


def fp32_matmul_tol(reduction_len: int, magnitude: float, layers: int = 1, *, eps: float = FP32_EPS) -> float:
    """Largest expected |difference| between two summation orders of fp32 results of scale
    ``magnitude`` (the largest |value| compared) computed through ``layers`` chained reductions
    of length at most ``reduction_len``: LAMBDA * eps * sqrt(reduction_len * layers) * magnitude.
    ``eps=FP64_EPS`` for float64 computations."""
    assert reduction_len >= 1 and layers >= 1 and magnitude >= 0
    return LAMBDA * eps * math.sqrt(reduction_len * layers) * magnitude


def transformer_logits_tol(a: Any, magnitude: float, context: int = 1) -> float:
    """``fp32_matmul_tol`` for the logits (or any activation after the last block) of a
    transformer over ``context`` positions; ``a`` is our torch backend's ``Args`` or a transformers
    config.  The longest reduction is the hidden size, the attention width, the MLP width or the
    context (P.V sums over positions; masked positions add exact zeros); 6 chained reductions per
    block plus the LM head."""
    if hasattr(a, "hidden_size"):  # a transformers config
        c = getattr(a, "text_config", None) or a
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        widths = [
            c.hidden_size,
            c.num_attention_heads * head_dim,
            c.intermediate_size or 0,
            getattr(c, "moe_intermediate_size", None) or 0,
        ]
        layers = c.num_hidden_layers
    else:
        widths = [a.hidden, a.heads * a.head_dim, a.intermediate, a.moe_intermediate, a.shared_intermediate]
        layers = a.layers
    return fp32_matmul_tol(max(*widths, context), magnitude, REDUCTIONS_PER_BLOCK * layers + 1)
