"""Chat prompt handling: templates, message normalisation."""

from .messages import normalize_messages
from .template import ChatTemplate

__all__ = ["ChatTemplate", "normalize_messages"]
