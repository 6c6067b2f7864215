"""Placeholder: transformers imports ``torchvision.io`` when it believes torchvision is installed; the
diffusers example never decodes images or video through it."""


def __getattr__(name: str):
    raise AttributeError(f"torchvision.io.{name}: not part of sdtrain's benchmark stand-in for torchvision")
