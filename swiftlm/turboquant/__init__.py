"""TurboQuant KV-cache compression: the backend-independent math (numpy).

codebook.py   Lloyd-Max codebooks for the post-rotation coordinate density at head dim d
rotation.py   seeded randomised Hadamard (power-of-two d) / Haar-random orthogonal (other d)
quantizer.py  TurboQuant-mse and TurboQuant-prod (b-1 bit mse + 1-bit QJL residual)
packing.py    bit planes that never split a code across bytes

presets.py    KV formats (TurboQuant presets, affine kv_bits), per-request resolution, the layout byte formula
attention.py  the numpy reference attention over compressed history
cpu_attention.py  numba kernels for decode rows over compressed history on a CPU (numpy + numba, optional):
              the torch backend's CPU path (``backends/torch/cpu_kernels.py``) and MLX on a CPU use them
cpu_merge.py  their partials merged with the 16-bit rows (one cache, or the rows of B caches in one call)
cpu_tiles.py  their building blocks (tile decode, exponential, softmax update, addresses), inlined

The caches live in the backends (``backends/torch/compressed_cache.py``, ``backends/mlx/turbo_cache.py``),
the kernels in ``cuda_ext/turboquant_kernels.py`` / ``cuda_ext/tq_codes.py`` (Triton) and
``metal_kernels/turboquant.py`` (Metal).
"""

from .codebook import Codebook, lloyd_max
from .quantizer import TurboQuantMSE, TurboQuantProd
from .rotation import Rotation

__all__ = ["Codebook", "Rotation", "TurboQuantMSE", "TurboQuantProd", "lloyd_max"]
