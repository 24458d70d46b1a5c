"""The `minimax-ref` command line: `build_parser` (every command, each from its own module: `generate` in
cli/generate.py, `synth` and `inspect` in cli/checkpoints.py, the research and export commands in `MODULE_COMMANDS`; the
model flags they share in cli/model_args.py) and `main`.

Every user error (bad flag values, bad checkpoint, bad input file) ends with one line
`error: ...` on stderr and exit status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import MiniMaxRefError
from .checkpoints import build_inspect_parser, build_synth_parser, run_inspect, run_synth
from .generate import build_generate_parser, run_generate
from .model_args import check_offload_command

# Commands implemented in their own modules: each module has `build_parser(p)` and `run(args) -> int`.
MODULE_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("score", "minimax_ref.research.score", "per-token log-likelihood of completions; drift and top-1 agreement "
                                            "against a reference checkpoint"),
    ("eval", "minimax_ref.cli.eval", "generation over a tasks file, graded by exact final answer and exact tool call; "
                                     "side by side with a reference checkpoint"),
    ("prune", "minimax_ref.weights.prune", "write an expert-pruned checkpoint (keep N routed experts per MoE layer)"),
    ("plan", "minimax_ref.research.plan", "per-card weight memory at tensor parallelism N and the KV-cache pool"),
    ("golden", "minimax_ref.golden", "export golden tensors (op inputs/outputs, paged KV, packed operands) for "
                                     "kernel tests, or replay a bundle"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minimax-ref", description="Reference inference engine for MiniMax-M3 "
                                     "(minimax_m3_vl) checkpoints in the release format.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, build, run, help_ in (
        ("generate", build_generate_parser, run_generate, "generate text from a checkpoint"),
        ("synth", build_synth_parser, run_synth, "write a synthetic checkpoint in the release format"),
        ("inspect", build_inspect_parser, run_inspect, "validate a checkpoint and summarise it"),
    ):
        p = sub.add_parser(name, help=help_, description=help_)
        build(p)
        p.set_defaults(run=run)
    import importlib

    for name, module, help_ in MODULE_COMMANDS:
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=help_)
        mod.build_parser(p)
        p.set_defaults(run=mod.run)
    return parser


def import_torch_holding_ctrl_c() -> None:
    """Import torch with Ctrl-C held back until the import is done, then honoured (KeyboardInterrupt): a
    KeyboardInterrupt raised inside torch's C++ extension initialisation ends the process with a C++ `terminate`
    (SIGABRT, no exit status 130)."""
    import signal
    import threading

    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        import torch  # noqa: F401

        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and previous is not signal.SIG_IGN:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The `minimax-ref` program: 0 on success, 1 when a command reports problems (inspect, plan, batch lines),
    2 for a user error (one `error:` line), 130 on Ctrl-C (at any moment, imports included: no traceback)."""
    try:
        import_torch_holding_ctrl_c()  # the command modules import it; Ctrl-C inside it must not abort
        args = build_parser().parse_args(argv)
        check_offload_command(args)
        return args.run(args)
    except MiniMaxRefError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
