"""From a raw WebDataset sample to tensors: the image cropped to its bucket, the caption (class prompts,
templates, dropout), or a pre-encoded sample's latents and text embedding; filters applied.

A decoder made with ``clips=True`` (for a model of clips) also reads clips (``sdtrain.data.video``): every frame of
one is given the same resize, crop and flip, as an image's mask and companions are, into pixels (3, T, H, W); an
image then becomes a clip of one frame. Without it, a clip is a mistake in the data, said in one line."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from sdtrain.config import DataConfig
from sdtrain.data.encoded import (
    ALPHA,
    CONDITIONING_IMAGE,
    LATENT_MEAN,
    LATENT_STD,
    MASK,
    MASK_IMAGE,
    SIZE_IDS,
    SOURCE_IMAGE,
    TEXT_FIELD_DIMS,
    TEXT_FIELDS,
    load_npy,
)
from sdtrain.data.filters import parse_filters
from sdtrain.data.images import parse_background, rgb_image
from sdtrain.data.prepare import DEFAULT_MAX_PIXELS
from sdtrain.data.video import CLIP_FIELD, read_clip
from sdtrain.errors import UserError


def load_class_prompts(path: str) -> dict[str, list[str]]:
    """``data.class_prompts``: class index -> prompt or list of prompts, as lists."""
    try:
        mapping = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"data.class_prompts: cannot read {path} ({exc}); give a JSON object of index -> prompt") from None
    if not isinstance(mapping, dict) or not mapping:
        raise UserError(f"data.class_prompts: {path} is not a JSON object of class index -> prompt")
    prompts = {}
    for key, value in mapping.items():
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise UserError(f"data.class_prompts: {path}: class {key} needs a prompt or a list of prompts")
        prompts[str(key)] = values
    return prompts


def make_buckets(config: DataConfig) -> list[tuple[int, int]]:
    """Aspect-ratio buckets: (width, height) pairs with sides multiples of `bucket_step`, about
    resolution^2 pixels each, aspects from 1/max_aspect to max_aspect, widest first."""
    step, area = config.bucket_step, config.resolution**2
    buckets = set()
    width = step
    while width <= area // step:
        height = int(area / width) // step * step
        if height >= step and 1 / config.max_aspect <= width / height <= config.max_aspect:
            buckets.update({(width, height), (height, width)})  # a tall bucket for every wide one
        width += step
    side = config.resolution // step * step
    buckets.add((side, side))
    return sorted(buckets, key=lambda wh: -wh[0] / wh[1])


def caption_lines(value: bytes | str) -> list[str]:
    """The captions a caption field holds (its bytes as a shard stores them, or text), one per non-blank line,
    stripped: the loader draws one of them, a tokenizer trains on each, validation loss scores the first,
    `prepare encode` embeds each."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return [line.strip() for line in text.splitlines() if line.strip()]


COMPANION_FIELDS = {"conditioning_pixels": CONDITIONING_IMAGE, "source_pixels": SOURCE_IMAGE}
"""Batch key -> sample field of the images a sample may carry beside its own, resized, cropped and flipped with it."""
SIGNED_COMPANIONS = ("source_pixels",)
"""Those in [-1, 1], as the image (what the VAE encodes); the others in [0, 1], as ControlNets read their maps."""


def present(field: str) -> str:
    """The batch key saying which samples carry the companion image `field` (a bool per sample)."""
    return f"{field}_present"


def _chw(img: Image.Image, signed: bool) -> torch.Tensor:
    """An RGB image as a 3xHxW float tensor in [-1, 1] (`signed`) or [0, 1]."""
    array = np.asarray(img, dtype=np.float32)
    array = array / 127.5 - 1.0 if signed else array / 255.0
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


def clip_refused(key: str) -> str:
    """The one line for a clip in the data of a model of still images."""
    return (f"data.shards: sample {key} is a clip (video), and this model trains on still images; train a video "
            "family (such as model.family: wan) on it, or prepare the folder again without its videos")


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a picture lands in its bucket: the size it is resized to (None: kept), the box cropped from that, whether
    it is flipped, and its size ids. Everything that goes with the picture (its mask, companion images, a clip's
    other frames) is given the same."""

    size: tuple[int, int] | None
    box: tuple[int, int, int, int]
    flip: bool
    size_ids: torch.Tensor

    def apply(self, img: Image.Image, resample: Image.Resampling = Image.Resampling.BICUBIC) -> Image.Image:
        """`img` resized (with `resample`), cropped and flipped as the placement says."""
        if self.size is not None:
            img = img.resize(self.size, resample)
        img = img.crop(self.box)
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if self.flip else img


@dataclass(frozen=True)
class Filtered:
    """A sample that data.filters rejected, and why."""

    reason: str


class SampleDecoder:
    """Turns a raw WebDataset sample into tensors; returns None for samples that cannot be used and
    `Filtered` for samples the configured filters reject."""

    def __init__(self, config: DataConfig, tokenizer: Any | None, seed: int, encoded: bool = False,
                 clips: bool = False, frame_step: int = 1):
        """`clips`: read clips (see the module docstring), for a model of clips whose frame counts are 1 + a multiple
        of `frame_step` (Wan's 4); a clip of another count is one line naming it."""
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.encoded = encoded
        self.clips = clips
        self.frame_step = frame_step
        self.image_keys = [k.strip() for k in config.image_key.split(";") if k.strip()]
        self.filters = parse_filters(config.filters)
        self.buckets = make_buckets(config) if config.aspect_buckets else []
        self.class_prompts = load_class_prompts(config.class_prompts) if config.class_prompts else None
        self.background = parse_background(config.background)
        """None: a colour drawn per sample (``random``)."""

    def _caption(self, raw: dict[str, Any], rng: np.random.Generator) -> tuple[str, int] | Filtered | None:
        """The sample's caption and which line of its caption field it was drawn from (0 for class prompts), None
        when it has none to offer, Filtered when a filter rejects it."""
        if self.class_prompts is not None:
            value = raw.get(self.config.class_key)
            try:
                prompts = self.class_prompts[str(int(value.decode() if isinstance(value, bytes) else value))]
            except (TypeError, ValueError, KeyError, UnicodeDecodeError):
                return None
            caption, line = prompts[int(rng.integers(len(prompts)))], 0
        else:
            caption, line = self._one_of(raw.get(self.config.caption_key, b""), rng)
        if self.filters:
            try:
                meta = json.loads(raw.get("json", b"{}"))
            except ValueError:
                meta = {}
            reason = self.filters.check(meta if isinstance(meta, dict) else {}, caption)
            if reason is not None:
                return Filtered(reason)
        templates = self.config.prompt_templates
        if templates:
            caption = templates[int(rng.integers(len(templates)))].replace("{caption}", caption)
        return caption, line

    def _one_of(self, text: bytes | str, rng: np.random.Generator) -> tuple[str, int]:
        """A caption field holds one caption per line: one is drawn each time the sample is (its place includes the
        epoch, so every epoch may draw another, and a resumed run draws the same), returned with its line. Tags
        then shuffle (``data.shuffle_tags``)."""
        captions = caption_lines(text)
        line = int(rng.integers(len(captions))) if len(captions) > 1 else 0
        caption = captions[line] if captions else ""
        if self.config.shuffle_tags:
            tags = [tag.strip() for tag in caption.split(",") if tag.strip()]
            keep = self.config.keep_tags
            caption = ", ".join(tags[:keep] + [tags[keep + i] for i in rng.permutation(len(tags) - keep)]
                                if len(tags) > keep else tags)
        return caption, line

    def __call__(self, raw: dict[str, Any], place: tuple[int, int, int]) -> dict[str, Any] | Filtered | None:
        rng = np.random.default_rng([self.seed, *place, 0xDA7A])
        image_bytes = next((raw[k] for k in self.image_keys if k in raw), None)
        clip = image_bytes is None and CLIP_FIELD in raw
        if clip and not self.clips:
            raise UserError(clip_refused(raw["__key__"]))
        drawn = self._caption(raw, rng)
        if drawn is None or isinstance(drawn, Filtered):
            return drawn
        caption, line = drawn
        if self.encoded:
            return self._encoded(raw, rng, caption, line)
        if clip:
            return self._clip(raw, rng, caption)
        if image_bytes is None:
            return None
        try:
            with Image.open(io.BytesIO(image_bytes)) as img:
                # The header's size, before decoding: a shard not made by `prepare` may hold a bomb.
                if img.width * img.height > DEFAULT_MAX_PIXELS:
                    return None
                img.load()
                background = self.background or tuple(int(c) for c in rng.integers(0, 256, 3))
                decoded = rgb_image(img, background)
            image = decoded.image
            mask = self._mask(raw, image.size, decoded.alpha)
            companions = {name: self._companion(raw, field, image.size, background)
                          for name, field in COMPANION_FIELDS.items() if field in raw}
            bucket = self._bucket(image.size)
            pixels, size_ids, mask, companions = self._transform(image, rng, self._target(bucket), mask, companions)
        except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
            return None
        draw = rng.random()
        if self.clips:
            pixels = pixels.unsqueeze(1)  # a clip of one frame
        # Batches never mix sizes nor frame counts.
        sample = {"pixel_values": pixels, "size_ids": size_ids, "key": raw["__key__"], "bucket": (bucket, 1),
                  **self._dropped(caption, draw), **companions}
        return sample if mask is None else {**sample, "mask": mask}

    def _target(self, bucket: int) -> tuple[int, int]:
        """The (width, height) a picture of `bucket` is cropped to."""
        return self.buckets[bucket] if self.buckets else (self.config.resolution,) * 2

    def _clip(self, raw: dict[str, Any], rng: np.random.Generator, caption: str) -> dict[str, Any] | None:
        """A clip: its frames (cropped back to the size its json gives, see sdtrain.data.video) all placed as the first
        is, as pixels (3, T, H, W) in [-1, 1]; its loss mask (every frame's) placed as they are, (1, H, W). A
        companion image beside it is not read."""
        try:
            meta = json.loads(raw.get("json", b"{}"))
        except ValueError:
            meta = {}
        size = None
        if isinstance(meta, dict) and isinstance(meta.get("width"), int) and isinstance(meta.get("height"), int):
            size = (meta["width"], meta["height"])
        try:
            frames = read_clip(raw[CLIP_FIELD], DEFAULT_MAX_PIXELS, size)
        except ValueError:
            return None
        if (len(frames) - 1) % self.frame_step:
            raise UserError(f"data.shards: sample {raw['__key__']} is a clip of {len(frames)} frames, and this model "
                            f"reads 1 + a multiple of {self.frame_step}; prepare its videos again with --frame-step "
                            f"{self.frame_step} and --frames such a count")
        bucket = self._bucket(frames[0].size)
        placement = self._placement(frames[0].size, rng, self._target(bucket))
        pixels = torch.stack([_chw(placement.apply(frame), signed=True) for frame in frames], dim=1)
        sample = {"pixel_values": pixels, "size_ids": placement.size_ids, "key": raw["__key__"],
                  "bucket": (bucket, len(frames)), **self._dropped(caption, rng.random())}
        try:
            mask = self._mask(raw, frames[0].size, None)  # every frame's
        except (OSError, ValueError, SyntaxError):
            return None
        if mask is None:
            return sample
        placed = placement.apply(mask, Image.Resampling.BILINEAR)
        return {**sample, "mask": torch.from_numpy(np.asarray(placed, dtype=np.float32) / 255.0)[None]}

    @staticmethod
    def _companion(raw: dict[str, Any], field: str, size: tuple[int, int],
                   background: tuple[int, int, int]) -> Image.Image:
        """The conditioning or source image a sample carries in `field`, upright and RGB (transparency on the
        image's `background`); ValueError when it is not the image's `size` (the sample is then skipped)."""
        with Image.open(io.BytesIO(raw[field])) as img:
            img.load()
            companion = rgb_image(img, background).image
        if companion.size != size:
            raise ValueError(f"{field} {companion.size} for an image of {size}")
        return companion

    def _mask(self, raw: dict[str, Any], size: tuple[int, int], alpha: Image.Image | None) -> Image.Image | None:
        """The sample's loss mask in its image's frame: its ``mask.png`` (any mode; white counts), else with
        data.alpha_mask its transparency; None when the whole image counts. A mask of another size than the
        (upright) image raises ValueError: the sample is skipped."""
        data = raw.get(MASK_IMAGE)
        if data is None:
            return alpha if self.config.alpha_mask else None
        with Image.open(io.BytesIO(data)) as img:
            mask = ImageOps.exif_transpose(img).convert("L")
        if mask.size != size:
            raise ValueError(f"mask {mask.size} for an image of {size}")
        return mask

    def _bucket(self, size: tuple[int, int]) -> int:
        """The bucket whose aspect ratio is nearest the image's (0 without buckets)."""
        if not self.buckets:
            return 0
        aspect = math.log(size[0] / size[1])
        return min(range(len(self.buckets)), key=lambda b: abs(math.log(self.buckets[b][0] / self.buckets[b][1])
                                                              - aspect))

    def _encoded(self, raw: dict[str, Any], rng: np.random.Generator, caption: str, line: int
                 ) -> dict[str, Any] | None:
        """A pre-encoded sample: the latent distribution (and the text embedding of its caption field's `line`,
        drawn as from images) instead of pixels."""
        if LATENT_MEAN not in raw or LATENT_STD not in raw:
            return None
        try:
            sample = {"latent_mean": torch.from_numpy(load_npy(raw[LATENT_MEAN]).astype(np.float32)),
                      "latent_std": torch.from_numpy(load_npy(raw[LATENT_STD]).astype(np.float32))}
            for key, field in TEXT_FIELDS.items():
                if field in raw:
                    embedding = load_npy(raw[field])
                    if embedding.ndim > TEXT_FIELD_DIMS[key]:  # one per caption line
                        embedding = embedding[line]
                    sample[key] = torch.from_numpy(embedding.astype(np.float32))
            for field in (MASK, ALPHA) if self.config.alpha_mask else (MASK,):
                if field in raw:
                    sample["mask"] = torch.from_numpy(load_npy(raw[field]).astype(np.float32))
                    break
            # Shards encoded before size ids were kept: centre crops of images taken to be square.
            side = self.config.resolution
            sample["size_ids"] = torch.from_numpy(load_npy(raw[SIZE_IDS]).astype(np.int64)) if SIZE_IDS in raw \
                else torch.tensor([side, side, 0, 0, side, side])
            sample.update(self._encoded_companions(raw, sample["size_ids"]))
        except (OSError, ValueError, IndexError, Image.DecompressionBombError, SyntaxError):
            return None
        # A clip's latents (C, t, h, w) batch with those of as many latent frames.
        frames = sample["latent_mean"].shape[1] if sample["latent_mean"].dim() == 4 else 1
        return {**sample, **self._dropped(caption, rng.random()), "key": raw["__key__"], "bucket": (0, frames)}

    def _dropped(self, caption: str, draw: float) -> dict[str, Any]:
        """The sample's caption, empty where its `draw` (uniform in [0, 1), one per sample from its place) falls
        below the share of captions dropped, whether it was, and the draw itself: a mode that drops what else a
        sample carries together with its caption (InstructPix2Pix's source) reads it, as its recipe draws one number
        per sample."""
        drop = bool(draw < self.config.dropped_captions())
        return {"caption": "" if drop else caption, "dropped": drop, "caption_draw": draw}

    def _encoded_companions(self, raw: dict[str, Any], size_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The conditioning and source images an encoded sample carries (as its source shard held them), resized and
        cropped as its image was before its latents were encoded: `size_ids` say the image's size, the crop's
        corner and its size (`prepare encode` never flips)."""
        height, width, top, left, crop_height, crop_width = (int(v) for v in size_ids)
        companions = {}
        for name, field in COMPANION_FIELDS.items():
            if field not in raw:
                continue
            # On the background `prepare encode` composited its image on (its DataConfig's).
            img = self._companion(raw, field, (width, height), parse_background(DataConfig.background))
            scale = max(crop_width / width, crop_height / height)
            if scale != 1.0:  # what `prepare encode` did (it always resizes the shorter side)
                img = img.resize((max(crop_width, round(width * scale)), max(crop_height, round(height * scale))),
                                 Image.Resampling.BICUBIC)
            img = img.crop((left, top, left + crop_width, top + crop_height))
            companions[name] = _chw(img, signed=name in SIGNED_COMPANIONS)
        return companions

    def _placement(self, size: tuple[int, int], rng: np.random.Generator, target: tuple[int, int]) -> Placement:
        """How a picture of `size` (width, height) becomes `target`: resized (only up, without data.resize) so it
        covers it, cropped (centre, or at a position drawn from `rng`) and flipped (drawn, with data.random_flip); its
        size ids are the original height and width, the crop's top and left in the resized picture (mirrored when
        flipped, so they still say what was cut off) and the target height and width."""
        width, height = target
        original = (size[1], size[0])
        scale = max(width / size[0], height / size[1])
        resized = None
        if scale != 1.0 and (self.config.resize or scale > 1.0):
            resized = size = (max(width, round(size[0] * scale)), max(height, round(size[1] * scale)))
        if self.config.center_crop:
            left, top = (size[0] - width) // 2, (size[1] - height) // 2
        else:
            left = int(rng.integers(0, size[0] - width + 1))
            top = int(rng.integers(0, size[1] - height + 1))
        box = (left, top, left + width, top + height)
        flip = bool(self.config.random_flip and rng.random() < 0.5)
        if flip:
            left = size[0] - left - width
        return Placement(resized, box, flip, torch.tensor([*original, top, left, height, width]))

    def _transform(self, img: Image.Image, rng: np.random.Generator, target: tuple[int, int],
                   mask: Image.Image | None = None, companions: dict[str, Image.Image] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """The image placed in `target` (`_placement`), its size ids, its `mask` given the same resize, crop and flip
        (1xHxW in [0, 1]), and its `companions` too (3xHxW: a conditioning image in [0, 1], as ControlNets read it; a
        source image in [-1, 1], as the image)."""
        placement = self._placement(img.size, rng, target)
        weights = None
        if mask is not None:
            mask = placement.apply(mask, Image.Resampling.BILINEAR)
            weights = torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None]
        placed = {name: _chw(placement.apply(c), signed=name in SIGNED_COMPANIONS)
                  for name, c in (companions or {}).items()}
        return _chw(placement.apply(img), signed=True), placement.size_ids, weights, placed
