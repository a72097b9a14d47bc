"""gouache: a serving engine for text-to-image and image-editing diffusion models."""

import logging

__version__ = "0.1.0"

# diffusers' pipeline modules import transformers' CLIPImageProcessor and SiglipImageProcessor
# (for safety checkers and IP adapters, which gouache never runs); without torchvision,
# transformers then warns at import that it falls back to their PIL versions. Drop exactly that
# notice, here, before any gouache module imports diffusers.
logging.getLogger("transformers.utils.import_utils").addFilter(
    lambda record: "requires torchvision (not installed)" not in record.getMessage()
)
