"""A stand-in for the few torchvision transforms diffusers' text-to-image example uses.

torchvision cannot be installed beside sdtrain's pinned CPU torch, so ``benchmarks/peer.py`` puts this
folder first on the PYTHONPATH of the diffusers example only (never of sdtrain). It implements
``transforms.Compose``, ``Resize``, ``CenterCrop``, ``RandomCrop``, ``RandomHorizontalFlip``, ``Lambda``,
``ToTensor``, ``Normalize``, ``InterpolationMode`` and ``transforms.functional`` (crop, to_tensor,
pil_to_tensor, normalize) on PIL images, with torchvision's semantics for those cases.

transformers finds this package and then believes torchvision is installed: at import it takes
``InterpolationMode`` and ``functional.pil_to_tensor`` from here (both provided) and imports ``io`` and
``transforms.v2.functional`` (placeholders whose attributes raise). Its image processors would need
those, but the example loads none (no safety checker, no feature extractor).
"""

from torchvision import io, transforms  # noqa: F401

STANDIN = True
# transformers parses this when it believes torchvision is installed (its image-processor defaults
# depend on it); 0.0 says "not a real torchvision" without breaking the parse.
__version__ = "0.0"
