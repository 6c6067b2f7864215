"""Placeholder for ``torchvision.transforms.v2.functional`` (imported by transformers, used by none of
what the diffusers text-to-image example runs)."""


def __getattr__(name: str):
    raise AttributeError(
        f"torchvision.transforms.v2.functional.{name}: not part of sdtrain's benchmark stand-in for torchvision")
