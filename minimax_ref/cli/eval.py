"""`minimax-ref eval`: generation over a tasks file, graded by exact final answer and exact tool call
(`research.tasks`), for a model and, side by side, its `--reference`.

The tasks are read and checked before anything loads; the model generates a reply to every task in one `generate`
call (continuous batching, greedy unless --temperature is given), with the interventions of --expert-mask /
--drop-experts when given; then, with --reference, the reference checkpoint (loaded after the first is freed) answers
the same tasks with the same settings and no interventions. Output: a table of the columns (text), or with
`--output-format json` one line per task and a last summary line whose `accuracy` is the fraction of tasks answered
right.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import InputError
from .arg_types import finite_float


def build_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `minimax-ref eval` (the model flags apply to both checkpoints; the interventions to the model only)."""
    from .model_args import add_intervention_flags, add_model_flags

    add_model_flags(p)
    add_intervention_flags(p)
    p.add_argument("--tasks", type=Path, required=True,
                   help="JSONL: per line 'prompt' or 'messages', 'answer' or 'tool_call', optional 'tools', "
                        "'thinking', 'system', 'max_new_tokens', 'id'")
    p.add_argument("--reference", type=Path, default=None,
                   help="reference checkpoint, evaluated on the same tasks (no interventions): its columns and the "
                        "paired differences")
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="most tokens per reply for tasks without their own (default: 512; a reply cut by it is "
                        "not finished, and not right)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=finite_float, default=1.0,
                   help="nucleus: the probability mass kept, in (0, 1] (default: 1.0, off)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of task 0 (task i: seed + i; default: 0)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="replies decoded together (default: generate's, sized from the memory left)")
    p.add_argument("--output-format", choices=["text", "json"], default="text",
                   help="text: the columns as a table; json: one line per task, then a summary line")


def _generate_and_grade(args: argparse.Namespace, path: Path | None, tasks, interventions_flags: bool):
    """Load one checkpoint (the model flags; `path` replaces --ckpt-path), answer every task, free the model; the
    results and grades in task order."""
    import gc

    import torch

    from ..research.intervened import cli_interventions
    from ..research.tasks import evaluate, grade_result
    from .model_args import load_from_args

    run_args = args if path is None else argparse.Namespace(**{**vars(args), "ckpt_path": path})
    model, tok, _ = load_from_args(run_args)
    iv = cli_interventions(args, model) if interventions_flags else None
    results = evaluate(model, tok, tasks, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_batch_size=args.max_batch_size,
                       interventions=iv, source=args.tasks)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results, [grade_result(t, r) for t, r in zip(tasks, results)]


def _check_lengths_before_loading(args: argparse.Namespace, tasks) -> None:
    """Refuse the tasks whose prompts leave no room under --max-model-len before any model loads, with each
    checkpoint's own tokenizer and position limit (the model's, then the --reference's), as `generate` checks its
    prompts. Where the tokenizer cannot be read here (synthetic weights, a folder the loader will refuse) the same
    check runs once the model has loaded (`tasks.evaluate`), naming the tasks the same way."""
    from ..research.tasks import check_task_lengths
    from .generate import _length_checker

    paths = [None] + ([args.reference] if args.reference is not None else [])
    for path in paths:
        checker = _length_checker(args if path is None else argparse.Namespace(**{**vars(args), "ckpt_path": path}))
        if checker is not None:
            tok, limit = checker
            check_task_lengths(tok, tasks, limit, args.tasks)


def _task_row(result, grades: dict) -> dict:
    return {**grades, "content": result.content, "tool_calls": result.tool_calls, "errors": result.errors,
            "finish_reason": result.finish_reason, "generated_tokens": len(result.token_ids)}


def _fmt(p, se) -> str:
    if p is None:
        return "-"
    return f"{p:.3f}" + ("" if se is None else f" ± {se:.3f}")


def _fmt_diff(d, se) -> str:
    if d is None:
        return "-"
    return f"{d:+.3f}" + ("" if se is None else f" ± {se:.3f}")


def table(summary: dict, reference: dict | None, difference: dict | None) -> str:
    """The columns as a text table: model, and with a reference its column and the paired difference."""
    from ..research.tasks import COLUMNS

    head = ["column", "model"] + (["reference", "difference"] if reference is not None else [])
    rows = [head]
    for c in COLUMNS:
        row = [c, _fmt(summary[c], summary[f"{c}_stderr"])]
        if reference is not None:
            row += [_fmt(reference[c], reference[f"{c}_stderr"]), _fmt_diff(difference[c], difference[f"{c}_stderr"])]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    """`minimax-ref eval`: exit status 0 (the grades are results, not errors)."""
    from ..generation.sampling import SamplingParams
    from ..research.intervened import cli_interventions
    from ..research.tasks import compare, read_tasks, summarize

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    SamplingParams(args.temperature, args.top_p, args.top_k)  # refused here, before anything loads
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise InputError(f"--max-batch-size {args.max_batch_size}: must be >= 1")
    if args.reference is not None and getattr(args, "synthetic_weights", None) is not None:
        raise InputError("--reference compares two checkpoints: give --ckpt-path, not --synthetic-weights")
    if args.reference is not None and not (args.reference / "config.json").is_file():
        raise InputError(f"--reference {args.reference}: no config.json there (not a checkpoint folder)")
    tasks = read_tasks(args.tasks)
    _check_lengths_before_loading(args, tasks)
    cli_interventions(args)  # a bad --expert-mask / --drop-experts is refused before the model loads
    results, grades = _generate_and_grade(args, None, tasks, True)
    summary = summarize(tasks, grades)
    ref_results = ref_grades = reference = difference = None
    if args.reference is not None:
        ref_results, ref_grades = _generate_and_grade(args, args.reference, tasks, False)
        reference = summarize(tasks, ref_grades)
        difference = compare(tasks, grades, ref_grades)
    from ..weights.embedded import default_checkpoint

    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "seed": args.seed,
                "expert_mask": None if args.expert_mask is None else str(args.expert_mask),
                "drop_experts": args.drop_experts}
    ckpt = str(args.ckpt_path or ("synthetic:" + args.synthetic_weights if getattr(args, "synthetic_weights", None)
                                  else default_checkpoint()))
    if args.output_format == "json":
        for i, (t, r, g) in enumerate(zip(tasks, results, grades)):
            row = {"line": t.line, **({"id": t.id} if t.id is not None else {}), "kind": t.kind, **_task_row(r, g)}
            if ref_results is not None:
                row["reference"] = _task_row(ref_results[i], ref_grades[i])
            print(json.dumps(row, ensure_ascii=False))
        out = {"ckpt_path": ckpt, **summary, "settings": settings}
        if reference is not None:
            out.update({"reference_path": str(args.reference), "reference": reference, "difference": difference})
        print(json.dumps(out, ensure_ascii=False), flush=True)
        return 0
    kinds = f"{summary['answer_tasks']} answer, {summary['tool_call_tasks']} tool call"
    print(f"{ckpt}: {summary['tasks']} tasks ({kinds}) from {args.tasks}"
          + (f"; reference {args.reference}" if reference is not None else ""))
    print(table(summary, reference, difference))
    sys.stdout.flush()
    return 0
