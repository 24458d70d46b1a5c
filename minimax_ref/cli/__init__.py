"""The `minimax-ref` command line (`main`): `python -m minimax_ref.cli` and the `minimax-ref` script.

Modules, one concern each: `main` (the parser of every command, `main`, Ctrl-C during imports), `model_args` (the
flags every model-loading command shares and the loading they ask for), `generate` (the generate command),
`checkpoints` (synth and inspect).
"""

from .main import main

__all__ = ["main"]
