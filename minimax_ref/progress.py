"""A minimal progress bar for long loads and writes: stderr only, and only when stderr is a
terminal and the work has already taken more than a moment (so tests and pipes stay quiet)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, *, unit: str = "B", delay_s: float = 0.5, stream=None):
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.delay_s = delay_s
        self.last = 0.0
        self.shown = False

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay_s or now - self.last < 0.1:
            return
        self.last = now
        self.shown = True
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(30 * frac)
        rate = self.done / max(now - self.start, 1e-9)
        amount = f"{self.done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB, {rate / 2**20:,.0f} MiB/s" \
            if self.unit == "B" else f"{self.done}/{self.total}"
        self.stream.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {amount}")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
