"""Duplicate images in a dataset (``sdtrain prepare --dedup``): the same file twice (exact: the same bytes), and,
with ``perceptual``, the same picture saved again (re-encoded, resized, recompressed; a perceptual hash from
imagehash within a few bits of an earlier one's). Scraped and hand-collected sets are full of both, and a duplicate
trains its image twice as often as the rest: a model memorises what it sees repeated."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from PIL import Image

from sdtrain.errors import UserError

DEDUP_MODES = ("exact", "perceptual", "none")
HASH_BITS = 64


class Duplicates:
    """The images kept so far, to tell whether the next one repeats one of them. `distance`: the most bits a
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
        self.digests: set[bytes] = set()
        # Pigeonhole: two hashes within `distance` bits agree on at least one of `distance + 1` bands, so only
        # hashes sharing a band with the new one are compared, not every hash kept.
        self.bands = [(start, min(HASH_BITS, start + -(-HASH_BITS // (distance + 1))))
                      for start in range(0, HASH_BITS, -(-HASH_BITS // (distance + 1)))]
        self.by_band: list[dict[int, list[int]]] = [{} for _ in self.bands]

    def check(self, data: bytes, picture: Callable[[], Image.Image]) -> tuple[str | None, Callable[[], None]]:
        """Whether the image (its file's `data`; `picture` decodes it as training sees it) repeats a kept one: the
        skip reason (``duplicate_image``, ``near_duplicate``) or None, and a call that remembers it as kept (for
        after every other check has passed, so a filtered image does not shadow a later copy)."""
        if self.mode == "none":
            return None, lambda: None
        digest = hashlib.sha256(data).digest()
        if digest in self.digests:
            return "duplicate_image", lambda: None
        if self.mode != "perceptual":
            return None, lambda: self.digests.add(digest)
        value = self._hash(picture())
        if self._near(value):
            return "near_duplicate", lambda: None

        def keep() -> None:
            self.digests.add(digest)
            for (start, end), table in zip(self.bands, self.by_band):
                table.setdefault(_band(value, start, end), []).append(value)

        return None, keep

    @staticmethod
    def _hash(image: Image.Image) -> int:
        import imagehash

        return int(str(imagehash.phash(image)), 16)

    def _near(self, value: int) -> bool:
        for (start, end), table in zip(self.bands, self.by_band):
            for other in table.get(_band(value, start, end), ()):
                if (value ^ other).bit_count() <= self.distance:
                    return True
        return False


def _band(value: int, start: int, end: int) -> int:
    return (value >> start) & ((1 << (end - start)) - 1)
