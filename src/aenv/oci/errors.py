"""The one base class of every error an image pull or unpack raises on purpose, so callers
(template builds, the CLI) can report them as the image's fault rather than a crash."""

from __future__ import annotations


class ImageError(Exception):
    """The image cannot be pulled or unpacked; the message says why and which image."""
