"""Duplicate samples in a dataset (``sdtrain prepare --dedup``): the same file twice (exact: the same bytes), and,
with ``perceptual``, the same picture saved again (re-encoded, resized, recompressed; a perceptual hash from
imagehash within a few bits of an earlier one's). Scraped and hand-collected sets are full of both, and a duplicate
trains its image twice as often as the rest: a model memorises what it sees repeated.

A sample repeats another only when every image it trains on does: its image and each image beside it (an edit's
source, a ControlNet's conditioning map, a loss mask), so edit pairs that share an edited image but start from
different sources are all kept (perceptual: each image within the distance of the kept sample's). Captions do not
count: the same pixels under two captions still train that picture twice (several captions of one image belong on
the lines of its one caption file)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping
from typing import NamedTuple

from PIL import Image

from sdtrain.data.images import rgb_image
from sdtrain.errors import UserError

DEDUP_MODES = ("exact", "perceptual", "none")
HASH_BITS = 64
WHITE = (255, 255, 255)


class Repeat(NamedTuple):
    """A sample found to repeat a kept one: the skip reason (``duplicate_image``, ``near_duplicate``) and the name
    the kept one was checked under."""

    reason: str
    of: str


class _Kept(NamedTuple):
    value: int
    others: tuple[tuple[str, int | None], ...]
    name: str


class Duplicates:
    """The samples kept so far, to tell whether the next one repeats one of them. `distance`: the most bits a
    perceptual hash may differ by and still be the same picture (of 64; 0 is the same hash)."""

    def __init__(self, mode: str = "exact", distance: int = 4):
        if mode not in DEDUP_MODES:
            raise UserError(f"--dedup: {mode!r} is not one of {', '.join(DEDUP_MODES)}")
        if not 0 <= distance < HASH_BITS // 2:
            raise UserError(f"--dedup-distance: must be between 0 and {HASH_BITS // 2 - 1} bits, got {distance}")
        if mode == "perceptual":
            try:
                import imagehash  # noqa: F401
            except ImportError:
                raise UserError("--dedup perceptual needs imagehash, which is not installed: pip install "
                                "'sdtrain[dedup]', or use --dedup exact") from None
        self.mode = mode
        self.distance = distance
        self.digests: dict[tuple, str] = {}
        # Pigeonhole: two hashes within `distance` bits agree on at least one of `distance + 1` bands, so only
        # hashes sharing a band with the new one are compared, not every hash kept.
        self.bands = [(start, min(HASH_BITS, start + -(-HASH_BITS // (distance + 1))))
                      for start in range(0, HASH_BITS, -(-HASH_BITS // (distance + 1)))]
        self.by_band: list[dict[int, list[_Kept]]] = [{} for _ in self.bands]

    def check(self, name: str, data: bytes, picture: Callable[[], Image.Image],
              others: Mapping[str, bytes] | None = None) -> tuple[Repeat | None, Callable[[], None]]:
        """Whether the sample `name` repeats a kept one: its image (its file's `data`; `picture` decodes it as training
        sees it) and the images beside it (`others`, their files' bytes by field) all the same. Returns the
        `Repeat` or None, and a call that remembers the sample as kept (for after every other check has passed, so
        a filtered sample does not shadow a later copy)."""
        if self.mode == "none":
            return None, lambda: None
        others = dict(sorted((others or {}).items()))
        digest = (_sha256(data), *((field, _sha256(value)) for field, value in others.items()))
        if digest in self.digests:
            return Repeat("duplicate_image", self.digests[digest]), lambda: None
        kept = None
        if self.mode == "perceptual":
            kept = _Kept(self._hash(picture()), tuple((field, _file_hash(value)) for field, value in others.items()),
                         name)
            near = self._near(kept)
            if near is not None:
                return Repeat("near_duplicate", near), lambda: None

        def keep() -> None:
            self.digests[digest] = name
            if kept is not None:
                for (start, end), table in zip(self.bands, self.by_band):
                    table.setdefault(_band(kept.value, start, end), []).append(kept)

        return None, keep

    def _near(self, new: _Kept) -> str | None:
        """The name of a kept sample whose image is within `distance` of `new`'s, and so is each image beside it."""
        for (start, end), table in zip(self.bands, self.by_band):
            for old in table.get(_band(new.value, start, end), ()):
                if self._close(new.value, old.value) and [f for f, _ in new.others] == [f for f, _ in old.others] \
                        and all(self._close(a, b) for (_, a), (_, b) in zip(new.others, old.others)):
                    return old.name
        return None

    def _close(self, value: int | None, other: int | None) -> bool:
        return value is not None and other is not None and (value ^ other).bit_count() <= self.distance

    @staticmethod
    def _hash(image: Image.Image) -> int:
        import imagehash

        return int(str(imagehash.phash(image)), 16)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _file_hash(data: bytes) -> int | None:
    """The perceptual hash of an image beside a sample's, decoded as training sees it; None for one that does not
    decode, which then matches only its exact copy (prepare has checked its header, not its pixels)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return Duplicates._hash(rgb_image(img, WHITE).image)
    except Exception:  # PIL raises many kinds on damaged files
        return None


def _band(value: int, start: int, end: int) -> int:
    return (value >> start) & ((1 << (end - start)) - 1)
