"""Image and audio inputs: fetching (data: URIs; files and http(s) only behind flags), decoding,
limits, and the model-family preprocessing that turns media into model inputs.

Core code: numpy, Pillow, soundfile, scipy and transformers' (numpy) processors; no mlx/torch.
"""

from .items import AudioClip, ImageItem, MediaItem, collect_part
from .policy import MediaPolicy, MediaTooLarge
from .processor import MediaInputs, MediaProcessor, MediaPrompt, processor_for

__all__ = [
    "AudioClip",
    "ImageItem",
    "MediaInputs",
    "MediaItem",
    "MediaPolicy",
    "MediaProcessor",
    "MediaPrompt",
    "MediaTooLarge",
    "collect_part",
    "processor_for",
]
