"""Process-wide settings that must be in place before torch allocates its first tensor.

A CPU training step of a large UNet allocates and frees gigabytes of gradients, weight casts and
activations every step; with the default allocator each fresh page is a page fault, and those faults
were about 45% of an SD2 step's CPU time on a 2-core machine. Two remedies, both measured there:
torch's own ``THP_MEM_ALLOC_ENABLE=1`` (2 MiB-aligned blocks backed by transparent huge pages: faults
10x fewer, the step +44%, peak memory +0.4 GiB) and glibc keeping freed blocks in its heap instead of
returning them to the kernel (+12-14%). Both are defaults a user can turn off: set
``THP_MEM_ALLOC_ENABLE=0``, or ``SDTRAIN_HOST_ALLOCATOR=default`` for neither.

The heap serves blocks below 4 MiB only; larger ones are mapped and unmapped whole. With glibc's ceiling of 32 MiB
instead, a step through many checkpointed blocks left its heap fragmented: on a Flux.1-dev-width LoRA (6 blocks,
fp8 base, 256 px) the step grew the process by 0.79 GiB over its weights, 0.42 GiB with 4 MiB (jemalloc: 0.38),
in the same time per step (46 s and 45-49 s). Growing with the number of blocks, that slack had the whole
57-block model's step killed for memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import MutableMapping

ALLOCATOR_ENV = "SDTRAIN_HOST_ALLOCATOR"
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below it are reused from the heap; larger ones (a layer's activations, a weight dequantised for one matmul)
# are mapped for their lifetime, so they cannot leave holes in it.
_MMAP_THRESHOLD = 4 * 2**20
_TRIM_THRESHOLD = 2**31 - 1


def tune_host_allocator(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Apply the allocator settings; returns what was applied. Child processes inherit the environment part."""
    if environ.get(ALLOCATOR_ENV, "").lower() == "default":
        return []
    applied = []
    if "THP_MEM_ALLOC_ENABLE" not in environ:
        environ["THP_MEM_ALLOC_ENABLE"] = "1"
        applied.append("THP_MEM_ALLOC_ENABLE=1")
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            if libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD):
                applied.append("glibc heap keeps freed blocks")
        except (OSError, AttributeError):  # not glibc (musl, say): nothing to tune
            pass
    return applied
