"""The flags every model-loading command shares (`add_model_flags`) and the loading they ask for (`load_from_args`):
checkpoint or synthetic weights, device and dtype, packed weights, `--fast` presets (`fast.paths.PRESETS`), offload.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from ..errors import ConfigError, InputError
from .arg_types import finite_float, positive_int


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model."""
    from ..fast.paths import AUTO_COMPILE_MIN_BYTES, USER_PRESETS, describe_presets

    p.add_argument("--ckpt-path", type=Path, default=None,
                   help="checkpoint folder (default: the embedded nano checkpoint shipped with the package)")
    p.add_argument("--device", default="cpu",
                   help="torch device (default: cpu; under examples/generate.py: cuda:LOCAL_RANK when CUDA is "
                        "available, else cpu)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="compute dtype: bfloat16, float32 (the golden mode), or auto (default: bfloat16 on a GPU, "
                        "float32 on a CPU)")
    p.add_argument("--act-quant", choices=["none", "emulate"], default="none",
                   help="fake-quantize NVFP4/MXFP8 linear inputs as W4A4/W8A8 kernels do (default: none)")
    p.add_argument("--weights", choices=["dequant", "packed"], default="dequant",
                   help="dequant: decode quantized weights once at load (default); packed: keep NVFP4/MXFP8 "
                        "weights packed in memory and decode them at use (same outputs, packed-size memory)")
    p.add_argument("--fast", choices=["auto", *USER_PRESETS], default="auto",
                   help="fast paths (minimax_ref/fast/): auto = with a CUDA --device compiled for models of "
                        f"{AUTO_COMPILE_MIN_BYTES >> 30} GiB of weights or more and on below (a compile does not pay "
                        "back on a small model), off on a CPU and with --offload (name on or compiled for an "
                        "offloaded model's steps cut where streamed weights are fetched, fast/segments.py); "
                        f"{describe_presets(USER_PRESETS)} (default: auto)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="KV and index-key cache storage: auto (compute dtype) or fp8 (e4m3, scale 1.0)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest sequence (prompt + generated tokens) the KV cache holds (default: 4096, or the "
                        "model's max_position_embeddings where that is smaller)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="tensor parallel (torchrun examples/generate.py): each rank holds whole routed experts "
                        "(E/TP per rank) instead of a slice of every expert")
    p.add_argument("--synthetic-weights", default=None, metavar="PRESET",
                   help="instead of --ckpt-path: random weights of a synth preset (tiny, tiny-vl, release, "
                        "pruned-80) generated directly on --device, in the release's formats; under torchrun each "
                        "rank generates only its slices (default weights for them: --weights as given)")
    p.add_argument("--synthetic-format", choices=["nvfp4", "mxfp8", "bf16"], default="nvfp4",
                   help="with --synthetic-weights: checkpoint format (default: nvfp4 = NVFP4 experts + MXFP8)")
    p.add_argument("--synthetic-layers", type=int, default=None, metavar="N",
                   help="with --synthetic-weights: number of layers (default: the preset's)")
    p.add_argument("--synthetic-experts", type=int, default=None, metavar="N",
                   help="with --synthetic-weights: routed experts per MoE layer (default: the preset's)")
    p.add_argument("--offload", choices=["none", "cpu", "disk"], default="none",
                   help="when the model does not fit --gpu-memory: keep the weights that do not fit packed in host "
                        "memory (cpu) or in --offload-folder (disk) and stream them to --device layer by layer, only "
                        "the chosen experts' rows of routed experts (needs --weights packed and the accelerate "
                        "package: pip install 'minimax-ref[offload]'; same outputs) (default: none)")
    p.add_argument("--gpu-memory", type=finite_float, default=None, metavar="GIB",
                   help="with --offload: GiB of --device memory the model may take (resident weights, staging "
                        "buffers, activations and KV cache); `minimax-ref plan --offload cpu` shows the device map")
    p.add_argument("--offload-folder", type=Path, default=None, metavar="DIR",
                   help="with --offload disk: where the streamed weights are written (default: a new folder under "
                        "the cache folder, removed at exit)")
    p.add_argument("--offload-prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="with --offload (generate, golden): copy the predicted experts' rows of the next streamed "
                        "stack ahead, overlapping compute (one more expert stack of staging; same outputs) (default: "
                        "on for --offload cpu on a CUDA device, off otherwise)")


def add_intervention_flags(p: argparse.ArgumentParser) -> None:
    """`--expert-mask FILE` and `--drop-experts L:E,...` (generate, score, eval; read by
    `research.intervened.cli_interventions`)."""
    p.add_argument("--expert-mask", type=Path, default=None, metavar="FILE",
                   help="route only to the experts a pruning.json keeps (what `minimax-ref prune` writes: the "
                        "pruned checkpoint's routing, emulated on this one), or to those of a JSON {layer: [kept ids]}")
    p.add_argument("--drop-experts", action="append", default=None, metavar="LAYER:E[,E...]",
                   help="never route to these experts of this MoE layer (repeatable; combines with --expert-mask)")


def load_from_args(args: argparse.Namespace, world=None):
    """(model, tokenizer, checkpoint path) for the model flags.

    world: the tensor-parallel `parallel.World` to load over (default: `args.world`, which
    examples/generate.py sets under torchrun; else one process).
    """

    from ..generation.tokenizer import load_tokenizer
    from ..weights.embedded import default_checkpoint
    from ..weights.loader import load_model, load_synthetic, resolve_device, resolve_dtype

    check_device_flag(args.device)
    dtype = resolve_dtype(args.dtype, resolve_device(args.device))
    world = world if world is not None else getattr(args, "world", None)
    fast = fast_mode(getattr(args, "fast", "auto"), args.device)
    if fast in COMPILE_NOTICES:
        _compile_notice(f"--fast {fast}", fast)
    if getattr(args, "expert_parallel", False) and (world is None or world.size == 1):
        print("note: --expert-parallel has no effect in one process (this process holds every expert); it spreads "
              "whole experts over the ranks of `torchrun --nproc-per-node N examples/generate.py`", file=sys.stderr)
    common = dict(device=args.device, dtype=dtype, act_quant=args.act_quant, weights=args.weights,
                  max_seq_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, tp=world,
                  expert_parallel=getattr(args, "expert_parallel", False), fast=fast,
                  offload=getattr(args, "offload", "none"), gpu_memory=getattr(args, "gpu_memory", None),
                  offload_folder=getattr(args, "offload_folder", None))
    if getattr(args, "offload_prefetch", None) is not None and common["offload"] != "none":
        from ..weights.offload import OffloadConfig

        common["offload"] = OffloadConfig.of(common["offload"], common["gpu_memory"], common["offload_folder"])
        common["offload"] = dataclasses.replace(common["offload"], prefetch=args.offload_prefetch)
    preset = getattr(args, "synthetic_weights", None)
    if preset is None:
        if getattr(args, "synthetic_layers", None) is not None or getattr(args, "synthetic_experts", None) is not None:
            raise InputError("--synthetic-layers and --synthetic-experts need --synthetic-weights")
        path = args.ckpt_path or default_checkpoint()
        model = load_model(path, **common)
        report_load(model, fast)
        return model, load_tokenizer(path), path
    from ..weights.synth import PRESETS

    if args.ckpt_path is not None:
        raise InputError("give --ckpt-path or --synthetic-weights, not both")
    if preset not in PRESETS:
        raise InputError(f"--synthetic-weights {preset!r}: choose one of {sorted(PRESETS)}")
    try:
        model = load_synthetic(preset, format=args.synthetic_format, layers=args.synthetic_layers,
                               experts=args.synthetic_experts, **common)
    except ConfigError as e:
        # build_config names the flags of `minimax-ref synth` (--experts, --layers); here they are --synthetic-*
        message = re.sub(r"^--(experts|layers) ", r"--synthetic-\1 ", str(e))
        if message == str(e):
            raise
        raise ConfigError(f"{message} (of --synthetic-weights {preset})") from None
    report_load(model, fast)
    # the tokenizer covers every id the model can emit: random weights sample from the whole vocabulary
    return model, load_tokenizer(synthetic_tokenizer_dir(model.config.text.vocab_size)), None


# The commands that pass --offload to the models they load (`load_from_args`, `score.load_for_args`).
OFFLOAD_COMMANDS = ("generate", "golden", "score", "prune")
# The commands whose models take --offload-prefetch (`load_from_args`).
PREFETCH_SWITCH_COMMANDS = ("generate", "golden")


def check_offload_command(args: argparse.Namespace) -> None:
    """Refuse --offload / --gpu-memory / --offload-folder on a command that would load its model without them."""
    if not hasattr(args, "offload_folder"):  # not a model-loading command (plan has an --offload of its own)
        return
    asked = args.offload != "none" or args.offload_folder is not None or args.gpu_memory is not None
    if asked and args.command not in OFFLOAD_COMMANDS:
        raise InputError(f"--offload is not available for `minimax-ref {args.command}` yet (it loads its models "
                         f"itself); commands that offload: {', '.join(OFFLOAD_COMMANDS)}")
    if getattr(args, "offload_prefetch", None) is not None:
        # score and prune load through `score.load_for_args`, which passes the mode alone (prefetch as by default)
        if args.offload == "none" or args.command not in PREFETCH_SWITCH_COMMANDS:
            raise InputError(f"--offload-prefetch / --no-offload-prefetch need --offload cpu|disk and one of: "
                             f"{', '.join(PREFETCH_SWITCH_COMMANDS)}")


def fast_mode(flag: str, device: str) -> bool | str:
    """`load_model`'s `fast` for `--fast flag` (a user preset of `fast.paths.PRESETS`, or "auto"): "auto" is the
    reference on a CPU (where the reference is the point, and compiling costs more than it saves) and on a CUDA
    device the loader's choice by the model's size (`fast.paths.auto_preset`: compiled layers for models large
    enough that compiling pays back, CUDA graphs alone for small ones)."""
    from ..fast.paths import USER_PRESETS

    if flag == "auto":
        return "auto" if device.startswith("cuda") else False
    if flag not in USER_PRESETS:
        raise InputError(f"--fast {flag}: choose one of {['auto', *USER_PRESETS]}")
    return {"off": False, "on": True}.get(flag, flag)


# What each compiling --fast preset compiles, said before the silence it causes.
COMPILE_NOTICES = {
    "compiled": "every decoder layer of a decode step is compiled by torch.compile on first use (minutes on a GPU "
                "at release size; the first decode step says when it starts and how long it took)",
}
COMPILE_NOTICES["gemv-mma"] = COMPILE_NOTICES["compiled"]
DEVICE_TYPES = ("cpu", "cuda")  # the devices the kernels and formats (float8, packed bytes) are written for


def check_device_flag(device: str) -> None:
    """Refuse a `--device` this engine does not run on (mps, xpu, ...) before anything is loaded."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise InputError(f"--device {device!r} is not a torch device; use cpu or cuda (cuda:N)") from None
    if kind not in DEVICE_TYPES:
        raise InputError(f"--device {device}: minimax-ref runs on cpu or cuda only ({kind} lacks the float8 and "
                         "packed-weight operations it needs); use --device cpu")


def _compile_notice(what: str, preset: str) -> None:
    print(f"[fast] {what}: {COMPILE_NOTICES[preset]}", file=sys.stderr)


def report_load(model, fast=None) -> None:
    """One stderr line per rank (printed by rank 0): bytes read, weight memory, seconds. Shown under
    tensor parallelism and on a terminal; quiet for one process writing to a pipe. With `--fast auto` (`fast`),
    the compile notice when the loader chose a compiling preset."""
    if fast == "auto" and getattr(model, "fast_preset", None) in COMPILE_NOTICES:
        _compile_notice(f"--fast auto chose {model.fast_preset} for this model's size", model.fast_preset)
    stats = model.load_stats
    world = getattr(model, "world", None)
    if (world is None or world.size == 1) and not sys.stderr.isatty():
        return
    rows = world.gather_objects(stats) if world is not None else [stats]
    for r, st in enumerate(rows):
        mem = st.get("memory_bytes")
        print(f"[load] rank {r}/{len(rows)}: read {st['bytes_read'] / 2**20:,.1f} MiB"
              + (f", weights in memory {mem / 2**20:,.1f} MiB" if mem is not None else "")
              + f" in {st['seconds']:.2f} s", file=sys.stderr)


def synthetic_tokenizer_dir(vocab: int):
    """A folder with the synthetic test tokenizer of `vocab` ids (written once into the cache folder, like the
    embedded default checkpoint): the text side of `--synthetic-weights` runs, whose weights are noise."""
    import shutil
    import tempfile

    from ..weights.embedded import cache_dir
    from ..weights.synth_tokenizer import write_test_tokenizer

    target = cache_dir() / f"synthetic-tokenizer-{vocab}"
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        write_test_tokenizer(tmp, vocab)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
