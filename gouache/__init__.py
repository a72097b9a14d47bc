"""gouache: a serving engine for text-to-image and image-editing diffusion models."""

__version__ = "0.1.0"
