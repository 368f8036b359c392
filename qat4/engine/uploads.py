"""The engine's small host-to-device copies: rows of ints straight into a device buffer.

Every step sends a few hundred integers to the device: its tokens, positions and slots (except a
verifying step, whose graph copies its rows in itself: ``ModelRunner.load_rows``), the
block-table entries allocated since the step before, and the slots and integer sampling parameters
of the sequences it admits. ``tensor.pin_memory().to(device)`` costs some
45 µs on an H200's host for that (a block from the caching host allocator, a new device tensor,
then a second copy into the step's buffer), and a speculating step pays it while the GPU waits
(:mod:`qat4.engine.speculation`). An :class:`Uploader` writes the rows into one of a ring of
pinned buffers it owns and copies that buffer into the destination with one asynchronous copy. A
buffer is written again only after the copy out of it has run: each copy records an event, and
the next use of the buffer waits for it (long past by then: the ring holds more copies than two
steps make, up to eight each, and the host never runs more than a step ahead of the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING = 16  # pinned buffers, used in turn
MIN_INTS = 4096  # a buffer's smallest size, in int64


class Uploader:
    """Sends rows of ints into contiguous int64 tensors on ``device`` without making the host wait."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * RING
        self._events = [torch.cuda.Event() for _ in range(RING)] if self._pinned else []
        self._next = 0

    def send(self, rows: Sequence[Sequence[int]], dst: torch.Tensor) -> torch.Tensor:
        """``rows[r]`` into ``dst[r, :len(rows[r])]`` for dst [len(rows), C], a contiguous int64
        tensor on the device; returns dst. The copy is enqueued on the current stream. On a GPU dst's
        other entries are overwritten with what the buffer held: a caller reads only the entries it sent."""
        if not self._pinned:
            host = dst.numpy()
            for r, row in enumerate(rows):
                host[r, : len(row)] = row
            return dst
        i = self._next
        self._next = (i + 1) % RING
        self._events[i].synchronize()  # the copy out of this buffer has run (at once for an unrecorded event)
        n = dst.numel()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[i] = torch.empty(max(n, MIN_INTS), dtype=torch.int64, pin_memory=True)
        staged = buffer[:n].view(dst.shape)
        host: np.ndarray = staged.numpy()
        for r, row in enumerate(rows):
            host[r, : len(row)] = row
        dst.copy_(staged, non_blocking=True)
        self._events[i].record()
        return dst

    def new(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Rows of as many ints each, as a new int64 tensor [len(rows), len(rows[0])] on the device
        (:meth:`send` into it)."""
        return self.send(rows, torch.empty((len(rows), len(rows[0])), dtype=torch.int64, device=self.device))
