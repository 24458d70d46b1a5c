"""Progress on stderr: a bar for long loads and writes (only on a terminal, once the work has taken more than a
moment, so tests and pipes stay quiet), and a generation run's requests, tokens per second and time left."""

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


class GenerationProgress:
    """Progress of a generation run on stderr: requests done / total, output tokens per second since the start,
    and the time left at that rate for the tokens still allowed (an upper bound: stop tokens end requests early).

    On a terminal one line rewritten in place (from `delay_s` on, at most ten times a second); elsewhere (a log
    file, a pipe) one line every `every_s` seconds of a run that lasts that long, so short runs stay quiet.
    `clock`: the time source (seconds)."""

    def __init__(self, requests: int, max_tokens: int, *, stream=None, delay_s: float = 0.5, every_s: float = 30.0,
                 clock=time.monotonic):
        self.requests, self.max_tokens = requests, max_tokens
        self.done = self.tokens = 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self.start = self.last = clock()
        self.delay_s, self.every_s = delay_s, every_s
        self.shown = False

    def token(self, n: int = 1) -> None:
        self.tokens += n
        self._maybe_show()

    def request_done(self, unused_tokens: int = 0) -> None:
        """One request finished; `unused_tokens` of its allowance it did not take (it stopped early)."""
        self.done += 1
        self.max_tokens -= unused_tokens
        self._maybe_show()

    def line(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.tokens / elapsed
        left = max(self.max_tokens - self.tokens, 0)
        eta = f"{left / rate:,.0f} s left at most" if rate > 0 and left else ("done" if not left else "starting")
        return (f"requests {self.done}/{self.requests}, {self.tokens:,} tokens, {rate:,.1f} tok/s, "
                f"{elapsed:,.0f} s, {eta}")

    def _maybe_show(self) -> None:
        now = self.clock()
        if self.tty:
            if now - self.start < self.delay_s or now - self.last < 0.1:
                return
            self.stream.write("\r" + self.line() + "\033[K")
        else:
            if now - self.last < self.every_s:
                return
            self.stream.write(f"[progress] {self.line()}\n")
        self.last = now
        self.shown = True
        self.stream.flush()

    def close(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()
