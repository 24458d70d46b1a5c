"""The seed's pruning study replayed on the nano model: keep 62.5 % of the routed experts (the seed's
80 of 128), then measure what that costs, with the engine's own commands.

    python examples/nano/prune_study.py --out /tmp/prune-study      # the shipped default, CPU, a few minutes

Stages:
1. traces: the full model writes completions (the seed's sampling: temperature 0.6, top-p 0.95, top-k 20)
   for fresh training-distribution prompts (arithmetic with thinking, weather and order tool calls, tool
   answers are not needed); half of them calibrate the pruning, the other half are scored. Traces are
   JSONL `{"input_ids", "completion_start"}` lines (`minimax-ref score`'s token form);
2. `minimax-ref prune --keep K --calibration calib.jsonl` (K = round(0.625 * experts), `--method weight`);
3. `minimax-ref score --ckpt-path PRUNED --reference FULL --traces eval.jsonl`: drift (1e-3 nats per
   completion token, with its standard error over traces) and top-1 agreement;
4. the copying table before / after: held-out cities and order ids copied exactly into tool calls
   (temperature 1.0, top-p 0.95; `eval.copying`), and held-out arithmetic (greedy; `eval.arithmetic`).

Prints a markdown table in the seed's layout and writes `study.json` in --out.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.nano` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.nano import data as nd
from examples.nano import eval as ne
from minimax_ref.generation.chat import EVAL_SAMPLING


def trace_prompts(gen: nd.TaskGenerator, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` generate() requests from the training distribution (never the held-out split): a third each
    arithmetic (thinking enabled), weather calls and order calls."""
    rng = random.Random(f"nano-prune-traces-{seed}")
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            a, op, b = gen.train_problem(rng)
            out.append({"prompt": nd.arithmetic_question(a, op, b, rng), "thinking": "enabled"})
        elif kind == 1:
            out.append({"prompt": nd.weather_request(gen.train_city(rng), rng.randint(1, 7), rng), "tools": nd.TOOLS})
        else:
            out.append({"prompt": nd.order_request(gen.train_order_id(rng), rng), "tools": nd.TOOLS})
    return out


def write_traces(model: Any, tok: Any, requests: list[dict[str, Any]], path: Path, batch: int, seed: int,
                 max_new_tokens: int) -> int:
    """Generate each request with the full model and write its token trace; returns completion tokens."""
    import minimax_ref as mr

    lines, tokens = [], 0
    for i in range(0, len(requests), batch):
        part = requests[i:i + batch]
        by_kind: dict[tuple, list[int]] = {}  # generate() renders one way per call: group alike requests
        for j, r in enumerate(part):
            by_kind.setdefault((r.get("thinking", "adaptive"), "tools" in r), []).append(j)
        for (thinking, with_tools), idx in by_kind.items():
            results = mr.generate(model, tok, [part[j]["prompt"] for j in idx], chat=True, thinking=thinking,
                                  tools=nd.TOOLS if with_tools else None, max_new_tokens=max_new_tokens,
                                  seed=seed + i, **EVAL_SAMPLING)
            for r in results:
                lines.append({"input_ids": r.prompt_token_ids + r.token_ids,
                              "completion_start": len(r.prompt_token_ids)})
                tokens += len(r.token_ids)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return tokens


def cli(*args: str) -> str:
    proc = subprocess.run([*ne._cli_command(), *args], capture_output=True, text=True, encoding="utf-8")
    if proc.returncode != 0:
        raise SystemExit(f"minimax-ref {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def measure(model: Any, tok: Any, heldout: nd.Heldout, args: argparse.Namespace) -> dict[str, Any]:
    """The copying table's columns for one model: held-out copying (sampled) and arithmetic (greedy)."""
    return {"copying": ne.copying(model, tok, heldout, args.n_cities, args.n_orders, args.batch, args.seed),
            "arithmetic": ne.arithmetic(model, tok, heldout, args.n_arith, args.batch, args.max_new_tokens)}


def study(args: argparse.Namespace) -> dict[str, Any]:
    import minimax_ref as mr
    from minimax_ref.model.config import load_model_config
    from minimax_ref.weights.embedded import default_checkpoint

    full = Path(args.ckpt_path or default_checkpoint())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heldout, _ = ne.load_heldout(full, None, args.seed)
    experts = load_model_config(full).text.num_local_experts
    keep = args.keep or round(0.625 * experts)

    model = mr.load_model(full, dtype="float32", max_batch_size=args.batch)
    tok = mr.load_tokenizer(full)
    requests = trace_prompts(nd.TaskGenerator(heldout), 2 * args.n_traces, args.seed)
    calib, evals = out / "calibration.jsonl", out / "eval.jsonl"
    calib_tokens = write_traces(model, tok, requests[0::2], calib, args.batch, args.seed, args.max_new_tokens)
    eval_tokens = write_traces(model, tok, requests[1::2], evals, args.batch, args.seed + 10_000,
                               args.max_new_tokens)
    full_measures = measure(model, tok, heldout, args)
    del model

    pruned = out / f"pruned-{keep}"
    cli("prune", "--ckpt-path", str(full), "--keep", str(keep), "--calibration", str(calib), "--out", str(pruned),
        "--method", args.method, "--dtype", "float32")
    score = json.loads(cli("score", "--ckpt-path", str(pruned), "--reference", str(full), "--traces", str(evals),
                           "--dtype", "float32").strip().splitlines()[-1])
    size = {name: sum(f.stat().st_size for f in p.glob("*.safetensors")) for name, p in (("full", full),
                                                                                           ("pruned", pruned))}
    result = {"experts": experts, "keep": keep, "method": args.method,
              "traces": {"calibration": args.n_traces, "eval": args.n_traces, "calibration_tokens": calib_tokens,
                         "eval_tokens": eval_tokens, "sampling": dict(EVAL_SAMPLING)},
              "score": score, "bytes": size,
              "full": full_measures,
              "pruned": measure(mr.load_model(pruned, dtype="float32", max_batch_size=args.batch), tok, heldout, args)}
    (out / "study.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return result


def table(r: dict[str, Any]) -> str:
    """The seed's table layout: one row for the full model, one for the pruned one."""
    s = r["score"]
    pruned_drift = (f"{s['drift_1e3']:+.1f} (s.e. {s['drift_stderr_1e3']:.1f}, {s['traces']} traces, "
                    f"{s['tokens']:,} tokens)")
    rows = ["| build | experts | size | drift (1e-3 nats/token) | top-1 agreement | cities copied | order ids copied "
            "| arithmetic |", "|---|---|---|---|---|---|---|---|"]
    for key, name, experts, drift, agree in (
            ("full", "nano, full", r["experts"], "0 (reference)", "100%"),
            ("pruned", f"nano, pruned {r['keep']} of {r['experts']}", r["keep"], pruned_drift,
             f"{100 * s['top1_agreement']:.1f}%")):
        c, a = r[key]["copying"], r[key]["arithmetic"]
        rows.append(f"| {name} | {experts} | {r['bytes'][key] / 1e6:.1f} MB | {drift} | {agree} | "
                    f"{c['cities']['exact']}/{c['cities']['n']} | {c['order_ids']['exact']}/{c['order_ids']['n']} | "
                    f"{a['correct']}/{a['n']} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-path", type=Path, default=None, help="the full model (default: the shipped default)")
    p.add_argument("--out", type=Path, required=True, help="folder for traces, the pruned checkpoint, study.json")
    p.add_argument("--keep", type=int, default=None, help="experts kept per layer (default: 62.5%% of them)")
    p.add_argument("--method", choices=["weight", "frequency"], default="weight")
    p.add_argument("--n-traces", type=int, default=200, help="traces scored (as many again calibrate)")
    p.add_argument("--max-new-tokens", type=int, default=400)
    p.add_argument("--n-cities", type=int, default=100)
    p.add_argument("--n-orders", type=int, default=50)
    p.add_argument("--n-arith", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    r = study(parse_args(argv))
    print(json.dumps({k: r[k] for k in ("experts", "keep", "score", "traces")}, ensure_ascii=False))
    print(table(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
