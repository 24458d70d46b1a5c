"""`minimax-ref golden`: flags and entry point (export, single ops, replay, a user's kernel)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..cli.arg_types import nonneg_int, positive_int
from ..errors import InputError
from ..outdir import check_new_folder
from .api import replay_impl
from .capture import export_golden, parse_layers, parse_ops
from .contract import OPS
from .replay import replay_bundle
from .single_ops import export_op


def build_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `minimax-ref golden` (model flags default to the float32 golden mode)."""
    from ..cli.model_args import add_model_flags

    add_model_flags(p)
    p.set_defaults(dtype="float32")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="render each prompt as one user turn")
    p.add_argument("--ops", default=None, help=f"comma list of ops (default: all): {','.join(OPS)}")
    p.add_argument("--layers", default=None,
                   help="comma list of decoder layers or ranges, e.g. 0,3-5 (default: all); final_norm and logits "
                        "(the head, layer index num_hidden_layers) are captured whenever --ops has them")
    p.add_argument("--out", type=Path, default=None, help="bundle folder to write (new or empty)")
    p.add_argument("--decode-steps", type=nonneg_int, default=1,
                   help="greedy decode steps after the prefill (default: 1)")
    p.add_argument("--page-size", type=positive_int, default=None,
                   help="tokens per KV page in the paged views (default: the MSA block size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the page permutation (default: 0)")
    p.add_argument("--replay", type=Path, default=None, metavar="BUNDLE",
                   help="instead of exporting, recompute every op of BUNDLE and report mismatches and error sizes")
    p.add_argument("--impl", default=None, metavar="MODULE:FUNCTION",
                   help="with --replay: test your kernel instead of the engine: FUNCTION(entry) gets each "
                        "golden.GoldenEntry (inputs on --device) and returns {output name: tensor} or None to skip")
    p.add_argument("--kernel-dtype", choices=["float32", "bfloat16"], default=None,
                   help="with --impl: the tolerance column to apply (default: the bundle's dtype)")
    p.add_argument("--skip-outputs", default=None, metavar="NAMES",
                   help="with --impl: comma list of outputs your kernel does not produce (e.g. x_hat,y2); any other "
                        "output it does not return fails")
    p.add_argument("--op", default=None, help="single-op bundle from random operands, no model: nvfp4_linear, "
                   "mxfp8_linear (--shape M,N,K), router (--shape T,E[,H]), moe (--shape T,E[,H,I]), "
                   "msa_decode (--context, --batch)")
    p.add_argument("--shape", default=None, help="with --op: the op's dimensions, comma-separated")
    p.add_argument("--context", default=None, help="with --op msa_decode: cached tokens per row: C (rows B: C, and "
                   "shorter rows below it, each a different length) or a comma list, one per row")
    p.add_argument("--batch", type=int, default=1, help="with --op msa_decode and one --context: rows (default: 1)")
    p.add_argument("--fp64", action="store_true", help="also store each float output evaluated in fp64 from the "
                   "same decoded operands (format-defined roundings kept; the manifest's contracts say which)")
    p.add_argument("--edge", default=None, help="with --op: an edge case (nvfp4_linear: subnormal-scales, "
                   "zero-scales; router: ties; moe: clamp; msa_decode: forced)")
    p.add_argument("--sweep", action="store_true", help="with --op: one entry per shape of the op's sweep (odd, "
                   "ragged and padded shapes) and per seed (--seed, +1, +2) instead of one --shape")
    p.add_argument("--stacked", action="store_true", help="moe entries (--op moe, or moe in a model-driven bundle): "
                   "also the stacked [E, ...] expert operands w13.* and w2.* (built from the per-expert ones in the "
                   "manifest, no bytes duplicated)")
    p.add_argument("--align-block", type=int, default=None, metavar="M", help="moe entries: also the routing "
                   "padded to blocks of M rows, as vLLM's moe_align_block_size (align.sorted_token_ids, "
                   "align.expert_ids, align.num_tokens_post_padded)")


def run(args: argparse.Namespace) -> int:
    """`minimax-ref golden`: write a bundle (prints a JSON summary) or replay one (exit 1 on mismatch)."""
    if args.replay is not None and args.impl is not None:
        ops = parse_ops(args.ops)[0] if args.ops else None
        skip = [n.strip() for n in (args.skip_outputs or "").split(",") if n.strip()]
        rep = replay_impl(args.replay, args.impl, ops=ops, device=args.device, kernel_dtype=args.kernel_dtype,
                          skip=skip)
        json.dump({"bundle": str(args.replay), "impl": args.impl, **rep}, sys.stdout)
        sys.stdout.write("\n")
        if rep["checks"] == 0:
            why = ("no entry" + (f" of --ops {args.ops}" if args.ops else "") if not rep["entries"] else
                   "the implementation returned None for every entry" if not rep["ran"] else
                   "every output was left out or missing")
            print(f"golden --replay --impl: nothing was checked ({why}); exit 1", file=sys.stderr)
        elif rep["missing"]:
            print(f"golden --replay --impl: {len(rep['missing'])} outputs were not given: "
                  f"{', '.join(rep['missing'][:5])}{' ...' if len(rep['missing']) > 5 else ''} (return them, or "
                  "name outputs your kernel does not produce in --skip-outputs)", file=sys.stderr)
        return 0 if rep["ok"] else 1
    if args.replay is not None:
        results = replay_bundle(args.replay, parse_ops(args.ops)[0] if args.ops else None)
        if not results:
            raise InputError(f"--replay {args.replay}: no entry of --ops {args.ops} in the bundle (nothing to check)")
        bad = [r for r in results if not r["ok"]]
        worst = {k: max((r[k] for r in results if k in r), default=0.0) for k in ("max_abs", "max_rel", "max_ulps")}
        worst["mismatched_ids"] = sum(r.get("mismatched", 0) for r in results)
        json.dump({"bundle": str(args.replay), "checks": len(results), "mismatches": bad, "worst": worst,
                   "results": results}, sys.stdout)
        sys.stdout.write("\n")
        return 1 if bad else 0
    if args.op is not None:
        if args.out is None:
            raise InputError("--op needs --out")
        check_new_folder(args.out)
        m = export_op(args.op, args.out, shape=args.shape, context=args.context, batch=args.batch,
                      dtype=getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32, seed=args.seed,
                      edge=args.edge, page_size=args.page_size, fp64=args.fp64, act_quant=args.act_quant,
                      sweep=args.sweep, stacked=args.stacked, align_block=args.align_block)
        files = [args.out / e["file"] for e in m["entries"]] + [args.out / w["file"] for w in m["weights_files"]]
        json.dump({"out": str(args.out), "op": args.op, "entries": len(m["entries"]), "files": len(files),
                   "bytes": sum(f.stat().st_size for f in files)}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    if not args.prompt or args.out is None:
        raise InputError("give --prompt and --out (or --replay BUNDLE, or --op OP)")
    check_new_folder(args.out)  # before the model loads
    from ..cli.model_args import load_from_args
    from ..generation.generate import encode_prompt
    from ..model.config import load_model_config
    from ..weights.embedded import default_checkpoint

    ops, explicit = parse_ops(args.ops)
    if args.synthetic_weights is None:  # a bad --layers is refused before the weights are read
        ckpt = args.ckpt_path or default_checkpoint()
        parse_layers(args.layers, load_model_config(ckpt).text.num_hidden_layers)
    model, tok, _ = load_from_args(args)
    layers = parse_layers(args.layers, model.text.num_hidden_layers)
    prompts = [encode_prompt(tok, p, chat=args.chat) for p in args.prompt]
    manifest = export_golden(model, prompts, args.out, ops=ops, layers=layers, explicit_ops=explicit,
                             decode_steps=args.decode_steps, page_size=args.page_size, seed=args.seed,
                             prompt_texts=args.prompt, fp64=args.fp64, stacked=args.stacked,
                             align_block=args.align_block)
    json.dump({"out": str(args.out), "files": len(manifest["entries"]),
               "ops": sorted({e["op"] for e in manifest["entries"]}), "layers": manifest["layers"]}, sys.stdout)
    sys.stdout.write("\n")
    return 0
