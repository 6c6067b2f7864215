"""Placeholder: transformers imports ``torchvision.transforms.v2.functional`` for its image processors,
which the diffusers example does not use."""

from torchvision.transforms.v2 import functional  # noqa: F401
