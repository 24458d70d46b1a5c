#!/usr/bin/env python
"""Generate with MiniMax-M3, tensor-parallel over the processes `torchrun` launches.

    torchrun --nproc-per-node 2 examples/generate.py --ckpt-path DIR --prompt "Hello"  # NCCL on GPUs, gloo on CPU
    python examples/generate.py --ckpt-path DIR --prompt "Hello"                       # one process

Takes every flag of `minimax-ref generate` (the parser and the run are minimax_ref/cli/generate.py's), plus
`--expert-parallel` (each rank holds whole routed experts instead of a slice of every expert) and
`--dist-timeout`. The device defaults to `cuda:LOCAL_RANK` when CUDA is available, else the CPU.

Each rank loads only its slices of the checkpoint. All ranks run the same generation: the logits
are gathered, so every rank holds identical logits and, with the same seed, samples identical
tokens. Only rank 0 prints (the other ranks' stdout and stderr are silenced) and, in
`--interactive` mode, only rank 0 reads the terminal and broadcasts each line. When a rank fails
to load (a bad checkpoint slice, out of memory) every rank stops with the error instead of waiting
for it; the process group's timeout bounds any other wait for a rank that has died. A rank that fails
later prints its traceback; the others, whose collectives then fail, say in one line that a peer failed.
Every rank destroys the process group and leaves with os._exit (exit status 1 after a failure, 2 for a
user error, 130 on Ctrl-C): C++ destructors of the communication threads run at a normal interpreter exit
and could abort the process (SIGABRT) after its work is done.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from minimax_ref.cli.arg_types import positive_float
from minimax_ref.cli.generate import build_generate_parser, run_generate
from minimax_ref.cli.model_args import check_device_flag
from minimax_ref.errors import MiniMaxRefError
from minimax_ref.model.parallel import World, is_peer_failure
from minimax_ref.weights.loader import resolve_device


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="examples/generate.py",
                                description="minimax-ref generate, tensor-parallel under torchrun")
    build_generate_parser(p)
    p.add_argument("--dist-timeout", type=timeout_seconds, default=1800.0,
                   help="seconds a collective may wait for the other ranks before failing (default: 1800; "
                        "a rank loads its slices before the first one)")
    p.set_defaults(device=None)  # auto: cuda:LOCAL_RANK when CUDA is available, else cpu
    return p


def timeout_seconds(text: str) -> float:
    """A collective's timeout: finite seconds > 0 that a timedelta holds (nan, 0 or 1e300 cannot time anything)."""
    v = positive_float(text)
    try:
        timedelta(seconds=v)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"{text} seconds is longer than a timeout can be") from None
    return v


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, every rank parsing them; a usage error or --help is printed by rank 0 alone (every rank has
    the same arguments), the other ranks waiting for it before they exit as it does."""
    parser = build_parser()
    if int(os.environ.get("RANK", "0")) == 0:
        return parser.parse_args(argv)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        try:
            return parser.parse_args(argv)
        except SystemExit as e:
            if e.code:
                time.sleep(RANK0_FIRST_S)
            raise


def init_world(device: str | None, timeout_s: float) -> tuple[World, str]:
    """The tensor-parallel World from torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT), and this rank's device. One process when WORLD_SIZE is unset or 1."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device_flag(device)
    resolve_device(device)  # no CUDA here: one clean ConfigError, before any CUDA call
    on_gpu = device.startswith("cuda")
    if size == 1:
        return World.single(), (f"cuda:{local_rank}" if device == "cuda" else device)
    if on_gpu:
        device = f"cuda:{local_rank}"  # one GPU per rank
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if on_gpu else None)
    return World.from_group(dist.group.WORLD, device), device


def rank0_input(world: World):
    """A replacement for `input` that reads on rank 0 and gives every rank the same line (or EOF)."""
    read = builtins.input

    def input_(prompt: str = "") -> str:
        line = None
        if world.rank == 0:
            try:
                line = read(prompt)
            except EOFError:
                line = None
        line = world.broadcast_object(line)
        if line is None:
            raise EOFError
        return line

    return input_


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        world, args.device = init_world(args.device, args.dist_timeout)
    except MiniMaxRefError as e:  # the same on every rank: rank 0 speaks for all
        speak_for_all(int(os.environ.get("RANK", "0")), f"error: {e}")
        return 2
    args.world = world  # cli.model_args.load_from_args loads the model tensor-parallel over it
    status, read_line = 0, builtins.input
    try:
        with contextlib.ExitStack() as quiet:
            if world.rank != 0:
                devnull = quiet.enter_context(open(os.devnull, "w"))
                quiet.enter_context(contextlib.redirect_stdout(devnull))
                quiet.enter_context(contextlib.redirect_stderr(devnull))
            if world.size > 1:
                builtins.input = rank0_input(world)
            status = run_generate(args)
    except MiniMaxRefError as e:
        # every rank raises (load failures are agreed on; input errors are the same on every rank):
        # rank 0 speaks for all
        speak_for_all(world.rank, f"error: {e}")
        status = 2
    except KeyboardInterrupt:
        status = 130
    except Exception as e:
        if world.size > 1 and is_peer_failure(e):
            # this rank's collective failed because another rank died: that rank printed the cause
            print(f"[rank {world.rank}] error: another tensor-parallel rank failed (its message is the cause): "
                  f"{str(e).splitlines()[0][:200]}", file=sys.__stderr__)
        else:
            # a bug or an out-of-memory on this rank alone: say which rank, whatever its number
            print(f"[rank {world.rank}] " + traceback.format_exc(), file=sys.__stderr__, end="")
        status = 1
    finally:
        builtins.input = read_line
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a failed peer: nothing left to release cleanly
                pass
    return status


# Seconds the other ranks wait after an error every rank has, so that rank 0 prints it first: torchrun stops
# every worker as soon as one exits non-zero, which could otherwise stop rank 0 before it has said anything.
RANK0_FIRST_S = 3.0


def speak_for_all(rank: int, message: str) -> None:
    """Print `message` (an error every rank has) once, from rank 0; the other ranks give it time to."""
    if rank == 0:
        print(message, file=sys.__stderr__, flush=True)
    else:
        time.sleep(RANK0_FIRST_S)


def exit_process(status: int) -> None:
    """Leave with `status`: flush the streams, then os._exit when torch.distributed was used (see the module
    docstring: skipping the C++ destructors of the communication threads avoids an abort at exit)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    exit_process(main())
