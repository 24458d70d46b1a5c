"""The `minimax-ref` command line (`main`): `python -m minimax_ref.cli` and the `minimax-ref` script.

Modules, one concern each: `main` (the parser of every command, `main`, Ctrl-C during imports), `model_args` (the
flags every model-loading command shares and the loading they ask for), `generate` (the generate command),
`checkpoints` (synth and inspect).

The command modules load with Ctrl-C held back: `main`'s own handler is not in force yet, and a Ctrl-C then ends the
program as one during a command does ("interrupted", exit status 130), never with a traceback.
"""

import signal as _signal
import sys as _sys
import threading as _threading

if (_threading.current_thread() is _threading.main_thread()
        and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler):
    _caught: list[int] = []
    _signal.signal(_signal.SIGINT, lambda signum, frame: _caught.append(signum))
    try:
        from .main import main
    finally:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    if _caught:
        print("interrupted", file=_sys.stderr)
        raise SystemExit(130)
else:  # a handler of the embedding program's (or none to install from this thread): left as it is
    from .main import main

__all__ = ["main"]
