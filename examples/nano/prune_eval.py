"""Accuracy beside drift for expert-pruned builds of the nano model, with the engine's commands only.

    python examples/nano/prune_eval.py --out /tmp/prune-eval                 # the shipped default, CPU, ~15 minutes
    python examples/nano/prune_eval.py --out /tmp/prune-eval --keep 12 --keep 8 --tasks examples/nano/tasks.jsonl

Stages (the seed's study, `prune_study.py`, with a generative evaluation in place of the copying table):
1. traces: the full model writes completions for training-distribution prompts (the seed's sampling); the
   first --n-calibration calibrate the pruning, the next --n-eval are scored (`prune_study.write_traces`);
2. for each --keep K: `minimax-ref prune --keep K --calibration calib.jsonl --method weight`;
3. `minimax-ref score --ckpt-path PRUNED --reference FULL --traces eval.jsonl`: drift and top-1 agreement;
4. `minimax-ref eval --ckpt-path PRUNED --reference FULL --tasks TASKS`: accuracy, with its standard error and the
   paired difference against the full model (greedy), and the same tasks under `--expert-mask PRUNED/pruning.json`
   on the full checkpoint, whose grades must be the pruned checkpoint's (the mask emulates the pruning).

Prints a markdown table and writes `prune_eval.json` in --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.nano` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.nano import data as nd
from examples.nano import eval as ne
from examples.nano import prune_study as ps

TASKS = Path(__file__).with_name("tasks.jsonl")


def eval_lines(*args: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`minimax-ref eval ... --output-format json`: the per-task lines and the summary line."""
    lines = [json.loads(x) for x in ps.cli("eval", *args, "--output-format", "json").strip().splitlines()]
    return lines[:-1], lines[-1]


def study(args: argparse.Namespace) -> dict[str, Any]:
    import minimax_ref as mr
    from minimax_ref.weights.embedded import default_checkpoint

    full = Path(args.ckpt_path or default_checkpoint())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout, _ = ne.load_heldout(full, None, args.seed)
    calib, evals = out / "calibration.jsonl", out / "eval.jsonl"
    if not (calib.is_file() and evals.is_file()):
        model = mr.load_model(full, dtype="float32", max_batch_size=args.batch)
        tok = mr.load_tokenizer(full)
        requests = ps.trace_prompts(nd.TaskGenerator(heldout), args.n_calibration + args.n_eval, args.seed)
        random.Random(args.seed).shuffle(requests)
        ps.write_traces(model, tok, requests[:args.n_calibration], calib, args.batch, args.seed, args.max_trace_tokens)
        ps.write_traces(model, tok, requests[args.n_calibration:], evals, args.batch, args.seed + 10_000,
                        args.max_trace_tokens)
        del model
    common = ["--tasks", str(args.tasks), "--max-new-tokens", str(args.max_new_tokens), "--dtype", "float32"]
    rows = []
    full_lines = None
    for keep in args.keep:
        pruned = out / f"pruned-{keep}"
        if not (pruned / "pruning.json").is_file():
            ps.cli("prune", "--ckpt-path", str(full), "--keep", str(keep), "--calibration", str(calib),
                   "--out", str(pruned), "--method", "weight", "--dtype", "float32")
        score = json.loads(ps.cli("score", "--ckpt-path", str(pruned), "--reference", str(full), "--traces",
                                  str(evals), "--dtype", "float32").strip().splitlines()[-1])
        lines, summary = eval_lines("--ckpt-path", str(pruned), "--reference", str(full), *common)
        masked_lines, masked = eval_lines("--ckpt-path", str(full), "--expert-mask", str(pruned / "pruning.json"),
                                          *common)
        same = [a["right"] for a in lines] == [b["right"] for b in masked_lines]
        full_lines = full_lines or [{"id": x.get("id"), **x["reference"]} for x in lines]
        rows.append({"keep": keep, "score": score, "eval": summary, "masked_eval": masked,
                     "mask_grades_equal_pruned": same,
                     "by_kind": by_kind(lines)})
    experts = json.loads((out / f"pruned-{args.keep[0]}" / "pruning.json").read_text())["source_num_experts"]
    return {"experts": experts, "traces": {"calibration": args.n_calibration, "eval": args.n_eval},
            "tasks": str(args.tasks), "max_new_tokens": args.max_new_tokens, "rows": rows,
            "full": {"eval": rows[0]["eval"]["reference"], "by_kind": by_kind(full_lines)}}


def by_kind(lines: list[dict[str, Any]]) -> dict[str, str]:
    """Right answers per task family (the id's prefix: arith, weather, order), as "right/n"."""
    counts: dict[str, list[int]] = {}
    for x in lines:
        c = counts.setdefault(str(x.get("id", "task")).split("-")[0], [0, 0])
        c[0] += bool(x["right"])
        c[1] += 1
    return {k: f"{r}/{n}" for k, (r, n) in counts.items()}


def table(r: dict[str, Any]) -> str:
    """One row per build: drift and agreement (score), accuracy and the paired difference (eval)."""
    def pm(x: float | None, se: float | None, scale: float = 1.0, sign: str = "") -> str:
        return "-" if x is None else f"{scale * x:{sign}.1f} ± {scale * (se or 0):.1f}"

    head = ("| experts (of {e}) | drift (1e-3 nats/token) | top-1 agreement | accuracy (%) | vs full (points) "
            "| arithmetic | weather calls | order calls | finished (%) | `--expert-mask` on the full model |")
    rows = [head.format(e=r["experts"]), "|---|---|---|---|---|---|---|---|---|---|"]
    f = r["full"]
    rows.append(f"| {r['experts']} (full) | - | - | {pm(f['eval']['accuracy'], f['eval']['accuracy_stderr'], 100)} | - "
                f"| {f['by_kind'].get('arith', '-')} | {f['by_kind'].get('weather', '-')} "
                f"| {f['by_kind'].get('order', '-')} | {100 * f['eval']['finished_rate']:.1f} | - |")
    for row in r["rows"]:
        s, e, d, m = row["score"], row["eval"], row["eval"]["difference"], row["masked_eval"]
        rows.append(f"| {row['keep']}, weight | {s['drift_1e3']:+.1f} ± {s['drift_stderr_1e3']:.1f} "
                    f"| {100 * s['top1_agreement']:.1f} % | {pm(e['accuracy'], e['accuracy_stderr'], 100)} "
                    f"| {pm(d['accuracy'], d['accuracy_stderr'], 100, '+')} | {row['by_kind'].get('arith', '-')} "
                    f"| {row['by_kind'].get('weather', '-')} | {row['by_kind'].get('order', '-')} "
                    f"| {100 * e['finished_rate']:.1f} | {100 * m['accuracy']:.1f} % "
                    f"({'same grades' if row['mask_grades_equal_pruned'] else 'grades differ'}) |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-path", type=Path, default=None, help="the full model (default: the shipped default)")
    p.add_argument("--out", type=Path, required=True, help="folder for traces, pruned checkpoints, prune_eval.json")
    p.add_argument("--keep", type=int, action="append", default=None, help="experts kept (repeat; default 12 and 8)")
    p.add_argument("--tasks", type=Path, default=TASKS, help=f"the eval tasks (default: {TASKS.name})")
    p.add_argument("--n-calibration", type=int, default=40)
    p.add_argument("--n-eval", type=int, default=22)
    p.add_argument("--max-trace-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per eval reply")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.keep = args.keep or [12, 8]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    r = study(args)
    (Path(args.out) / "prune_eval.json").write_text(json.dumps(r, indent=1, ensure_ascii=False) + "\n",
                                                    encoding="utf-8")
    print(table(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
