"""`minimax-ref synth` (write a synthetic checkpoint in the release format) and `minimax-ref inspect` (validate a
checkpoint and summarise it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError, MiniMaxRefError


def build_synth_parser(p: argparse.ArgumentParser) -> None:
    from ..weights.synth import FORMATS, PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="default: tiny")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--format", choices=list(FORMATS), default="bf16",
                   help="bf16, mxfp8, or nvfp4 (= NVFP4 routed experts + MXFP8 attention/shared/dense, as the "
                        "release) (default: bf16)")
    p.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument("--drafter", action="store_true",
                   help="also write a DSpark drafter in OUT/dspark at the target's shapes (release layout)")
    p.add_argument("--dry-run", action="store_true", help="print the tensor count and size, write nothing")
    p.add_argument("--config-only", action="store_true",
                   help="write only config.json and generation_config.json (no shards, no tokenizer): enough for "
                        "`minimax-ref plan --ckpt-path OUT`")


def run_synth(args: argparse.Namespace) -> int:
    from ..model.config import parse_model_config
    from ..weights.synth import build_config, plan_tensors, write_checkpoint, write_config

    if args.config_only and (args.drafter or args.dry_run):
        raise InputError(f"--config-only writes no weights: drop {'--drafter' if args.drafter else '--dry-run'}")
    if args.dry_run:
        cfg = parse_model_config(build_config(args.preset, args.format, args.experts, args.layers))
        count, nbytes = plan_tensors(cfg, args.format)
        print(json.dumps({"preset": args.preset, "format": args.format, "tensors": count, "bytes": nbytes}))
        return 0
    if args.config_only:
        out = write_config(args.out, args.preset, args.format, experts=args.experts, layers=args.layers)
        print(f"wrote {out / 'config.json'} and {out / 'generation_config.json'}")
        return 0
    out = write_checkpoint(args.out, args.preset, args.format, experts=args.experts, layers=args.layers,
                           seed=args.seed, progress=True, drafter=args.drafter)
    print(f"wrote {out}")
    return 0


def build_inspect_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_path", type=Path, help="checkpoint folder")
    p.add_argument("--quick", action="store_true",
                   help="check the headers only (names, shapes, dtypes, formats); by default every tensor is also "
                        "read and checked for NaN / Inf values, E4M3 NaN bytes and bad scales, as loading does")
    p.add_argument("--output-format", choices=["text", "json"], default="text")


def inspect_summary(path: Path, quick: bool = False) -> dict:
    """`minimax-ref inspect`'s summary of checkpoint `path`; `problems` lists everything loading would refuse
    (header problems always; tensor values too unless `quick`)."""
    from ..weights.checkpoint import check_values, open_checkpoint

    ck = open_checkpoint(path, strict=False)
    t = ck.config.text
    problems = list(ck.problems)
    if not quick and not problems:  # values are read only from shards whose headers are sound
        problems += check_values(ck)
    summary = {
        "path": str(path),
        "layers": t.num_hidden_layers,
        "layer_kinds": [t.layer_kind(i) for i in range(t.num_hidden_layers)],
        "hidden_size": t.hidden_size,
        "vocab_size": t.vocab_size,
        "experts": t.num_local_experts,
        "experts_per_token": t.num_experts_per_tok,
        "msa": {"block_size": t.sparse.block_size, "topk_blocks": t.sparse.topk_blocks,
                "dense_up_to_tokens": t.sparse.block_size * t.sparse.topk_blocks},
        "vision": ck.config.vision is not None,
        "formats": {k: sorted(v) for k, v in sorted(ck.family_formats().items())},
        "bytes": dict(sorted(ck.family_bytes().items())),
        "tensors": len(ck.tensors),
        "notes": ck.notes,
        "problems": problems,
    }
    pruning = path / "pruning.json"
    if pruning.is_file():
        summary["pruning"] = json.loads(pruning.read_text())
    try:
        from ..generation.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        summary["tokenizer"] = {"vocab_size": tok.vocab_size, "special_ids": tok.special_ids.as_dict(),
                                "eos_token_ids": list(tok.eos_token_ids)}
    except MiniMaxRefError as e:
        summary["problems"].append(f"tokenizer: {e}")
    return summary


def run_inspect(args: argparse.Namespace) -> int:
    s = inspect_summary(args.ckpt_path, args.quick)
    if args.output_format == "json":
        print(json.dumps(s, indent=2, ensure_ascii=False))
    else:
        kinds: dict[str, int] = {}
        for k in s["layer_kinds"]:
            kinds[k] = kinds.get(k, 0) + 1
        print(f"checkpoint  {s['path']}")
        print(f"layers      {s['layers']} ({', '.join(f'{n} x {k}' for k, n in kinds.items())})")
        print(f"hidden      {s['hidden_size']}, vocab {s['vocab_size']}, vision {'yes' if s['vision'] else 'no'}")
        print(f"experts     {s['experts']} per MoE layer, top-{s['experts_per_token']}")
        m = s["msa"]
        print(f"MSA         blocks of {m['block_size']}, top-{m['topk_blocks']} "
              f"(equals dense attention up to {m['dense_up_to_tokens']} tokens)")
        print(f"tensors     {s['tensors']}")
        print("family           format          bytes")
        for fam, fmts in s["formats"].items():
            print(f"  {fam:<14} {'/'.join(fmts):<15} {s['bytes'].get(fam, 0):>14,}")
        if "tokenizer" in s:
            sp = {k: v for k, v in s["tokenizer"]["special_ids"].items() if v is not None}
            print(f"tokenizer   vocab {s['tokenizer']['vocab_size']}, special ids {sp}")
        for note in s["notes"]:
            print(f"note        {note}")
        print(f"problems    {len(s['problems'])}")
        for p in s["problems"]:
            print(f"  - {p}")
    return 1 if s["problems"] else 0
