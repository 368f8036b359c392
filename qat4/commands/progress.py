"""A status line on stderr for long-running commands.

On a terminal the line is redrawn in place; when stderr is a file or a pipe, a line is printed at
most every few seconds, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

LOG_INTERVAL_S = 5.0


class ProgressLine:
    """Show `update(text)` on stderr; `done()` ends the line."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = LOG_INTERVAL_S):
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._interval = 0.0 if self._tty else interval_s
        self._last = float("-inf")
        self._width = 0
        self._text = ""
        self._held = False  # the last text is not on screen yet

    def update(self, text: str) -> None:
        self._text = text
        now = time.monotonic()
        self._held = now - self._last < self._interval
        if not self._held:
            self._last = now
            self._show()

    def done(self) -> None:
        """Show the last text if it was held back, then end the line."""
        if self._text:
            if self._held:
                self._show()
            if self._tty:
                self._stream.write("\n")
            self._stream.flush()
        self._text = ""

    def _show(self) -> None:
        if self._tty:
            self._stream.write("\r" + self._text.ljust(self._width))
            self._width = len(self._text)
        else:
            self._stream.write(self._text + "\n")
        self._stream.flush()
