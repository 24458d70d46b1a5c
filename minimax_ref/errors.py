"""Exception types raised by minimax-ref.

Every error a user can cause (a bad checkpoint, a bad config value, bad generation input) is one of
these, with a message that names the file, tensor or field at fault and says what to do.
"""

from __future__ import annotations


class MiniMaxRefError(Exception):
    """Base class of every error minimax-ref raises on purpose."""


class ConfigError(MiniMaxRefError):
    """A config.json value this engine cannot run (names the field and the value)."""


class CheckpointError(MiniMaxRefError):
    """A checkpoint folder that is missing files or tensors, or holds tensors of the wrong shape,
    dtype or encoding. `problems` lists every problem found, not just the first."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            shown = self.problems[:50]
            more = len(self.problems) - len(shown)
            message = message + "\n" + "\n".join(f"  - {p}" for p in shown)
            if more > 0:
                message += f"\n  ... and {more} more"
        super().__init__(message)


class QuantFormatError(MiniMaxRefError):
    """Packed NVFP4/MXFP8 data that cannot be decoded (bad shape, NaN or reserved scale code)."""


class InputError(MiniMaxRefError):
    """Bad input to generation or scoring: prompt, sampling parameters, token ids, images, files."""


class NumericsError(MiniMaxRefError):
    """A forward pass produced NaN or Inf (names the layer where they first appeared), or a result that would
    carry them (a score). Damaged weights or config values are the usual cause: `minimax-ref inspect` reads
    every tensor."""
