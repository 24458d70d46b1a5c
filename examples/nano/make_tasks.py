"""Write the nano model's evaluation tasks for `minimax-ref eval` (`examples/nano/tasks.jsonl`, as shipped).

    python examples/nano/make_tasks.py [--out examples/nano/tasks.jsonl] [--n-arith 24] [--n-weather 8] [--n-orders 8]

Every item is held out from training (the split recorded in the embedded default's `nano_run.json`): arithmetic
problems asked with thinking enabled (`answer`: the result), weather requests for held-out cities and order lookups
of held-out order ids with the nano tools offered (`tool_call`: get_weather(city, days) / get_order(order_id)).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `examples.nano` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.nano import data as nd
from examples.nano import eval as ne


def tasks(heldout: nd.Heldout, n_arith: int, n_weather: int, n_orders: int, seed: int = 0) -> list[dict]:
    """The task lines: arithmetic first, then weather calls, then order calls."""
    rng = random.Random(f"nano-eval-tasks-{seed}")
    out: list[dict] = []
    for i, (a, op, b) in enumerate(heldout.arithmetic[:n_arith]):
        out.append({"id": f"arith-{i}", "prompt": nd.arithmetic_question(a, op, b, rng), "thinking": "enabled",
                    "answer": str(nd.solve(a, op, b))})
    for i, city in enumerate(heldout.cities[:n_weather]):
        days = rng.randint(1, 7)
        out.append({"id": f"weather-{i}", "prompt": nd.weather_request(city, days, rng), "tools": nd.TOOLS,
                    "tool_call": {"name": "get_weather", "arguments": {"city": city, "days": days}}})
    for i, order in enumerate(heldout.order_ids[:n_orders]):
        out.append({"id": f"order-{i}", "prompt": nd.order_request(order, rng), "tools": nd.TOOLS,
                    "tool_call": {"name": "get_order", "arguments": {"order_id": order}}})
    return out


def main(argv: list[str] | None = None) -> int:
    from minimax_ref.weights.embedded import default_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("tasks.jsonl"))
    p.add_argument("--ckpt-path", type=Path, default=None, help="whose held-out split (default: the embedded one)")
    p.add_argument("--n-arith", type=int, default=24)
    p.add_argument("--n-weather", type=int, default=8)
    p.add_argument("--n-orders", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    heldout, source = ne.load_heldout(Path(args.ckpt_path or default_checkpoint()), None, args.seed)
    lines = tasks(heldout, args.n_arith, args.n_weather, args.n_orders, args.seed)
    args.out.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in lines), encoding="utf-8")
    print(f"wrote {len(lines)} tasks to {args.out} (held-out items from {source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
