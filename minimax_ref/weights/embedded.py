"""The embedded default checkpoint: the trained nano model shipped inside the package.

`minimax-ref generate` (and `score`, `prune`, `golden`) use it when no `--ckpt-path` is given. It is a
30.7 M-parameter model of the release's architecture (dense and MSA layers, MoE with a shared expert,
a vision tower) trained by `examples/nano/train.py` on generated arithmetic, tool-use, number-image and
text data, stored in the release's format (NVFP4 routed experts, MXFP8 attention / indexer / shared /
dense linears, the rest bf16) with a DSpark drafter in `dspark/`. `nano_run.json` beside the weights
records how it was trained and its held-out split (examples/nano/README.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "default_checkpoint"


def default_checkpoint() -> Path:
    """The shipped checkpoint folder; a CheckpointError saying what to do when the package lacks it."""
    if not (DEFAULT_CHECKPOINT / "model.safetensors.index.json").is_file():
        raise CheckpointError(
            f"the embedded default checkpoint is missing from {DEFAULT_CHECKPOINT} (an install without the "
            "package data?): reinstall minimax-ref with `pip install -e .` from the repository, or give --ckpt-path")
    return DEFAULT_CHECKPOINT


def cache_dir() -> Path:
    """Where files made on first use are kept (synthetic tokenizers): $MINIMAX_REF_CACHE, else
    $XDG_CACHE_HOME/minimax-ref, else ~/.cache/minimax-ref."""
    root = os.environ.get("MINIMAX_REF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minimax-ref")
    return Path(root)
