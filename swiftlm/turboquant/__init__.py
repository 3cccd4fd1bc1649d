"""TurboQuant KV-cache compression: the backend-independent math (numpy).

codebook.py   Lloyd-Max codebooks for the post-rotation coordinate density at head dim d
rotation.py   seeded randomised Hadamard (power-of-two d) / Haar-random orthogonal (other d)
quantizer.py  TurboQuant-mse and TurboQuant-prod (b-1 bit mse + 1-bit QJL residual)
packing.py    bit planes that never split a code across bytes

The KV cache, attention over packed codes and the kernels that use this are not built yet
(``--turbo-kv`` still exits with "not supported yet").
"""

from .codebook import Codebook, lloyd_max
from .quantizer import TurboQuantMSE, TurboQuantProd
from .rotation import Rotation

__all__ = ["Codebook", "Rotation", "TurboQuantMSE", "TurboQuantProd", "lloyd_max"]
