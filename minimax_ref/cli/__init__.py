"""The `minimax-ref` command line (`main`): `python -m minimax_ref.cli` and the `minimax-ref` script."""

from .main import main

__all__ = ["main"]
