"""DSpark verification: the verify step the speculative loop replays, against the same step launched from the host
and against a plain decode step, measured in one run.

A synthetic target (`--preset`, `--layers`, `--experts`, NVFP4+MXFP8 packed, fp8 KV, `--fast`) and a random DSpark
drafter at its shapes (`synth.write_drafter` into a temporary folder: the release's drafter for a 60-layer target,
block 7) run `speculative.SpeculativeDecoder.generate` greedily for `--new-tokens` tokens after a `--prompt-len` prompt:
the loop `minimax-ref generate --speculative dspark` runs, whose verify steps (`MiniMaxM3.step_with_hidden`: the
anchor and k drafts, the drafter's layers kept) replay CUDA graphs. A random drafter's drafts are nearly always
rejected, so the loop's tokens/s is not a speculation figure; the step times are. Then, on the cache the loop left:

* the captured verify step of k+1 = block + 1 tokens replayed `--steps` times alone (CUDA events);
* the same step launched from the host (`FastMiniMaxM3.sync_free_step`: the same fast paths, compiled layers
  included, without the graph);
* the plain decode step (one token, `MiniMaxM3.step`: compiled and captured on its first call) replayed.

One JSON line: ms per step of each, the graph's speed-up over the launches, the verify step's cost in plain decode steps
(what a step that emits n tokens must beat), the drafter's pass alone (launched from the host), the loop's verify and
draft ms per step (its wall time: synchronised), and the loop's stats; `--profile` adds the device time per kernel
kind of one verify replay and of one drafter pass.

    # 1 x H200, release widths, 60 layers, 16 experts, a 1K prompt:
    python benchmarks/speculative_decode.py --layers 60 --experts 16 --prompt-len 1024 --out spec.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from common import BenchmarkError, emit, event_ms, main_guard
from generate_decode import add_model_args, load_model, replay_time

from minimax_ref.generation.drafter import load_drafter
from minimax_ref.generation.sampling import SamplingParams
from minimax_ref.generation.speculative import SpeculativeDecoder
from minimax_ref.weights.synth import write_drafter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, 1024)
    p.add_argument("--new-tokens", type=int, default=48, help="tokens the speculative loop makes (default: 48)")
    p.add_argument("--steps", type=int, default=30, help="replays and launched steps timed (default: 30)")
    p.add_argument("--profile", action="store_true",
                   help="device ms per kernel kind of one verify replay and of one drafter pass (CUDA)")
    p.add_argument("--top", type=int, default=12, help="kernels listed by --profile (default: 12)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="also append the JSON line to this file")
    return p.parse_args(argv)


def launched_time(model, graph, layers: tuple[int, ...], steps: int) -> float:
    """ms per run of the step `graph` recorded (its inputs, cache and kept layers) launched from the host (what the
    graph saves: the launches are on the host's clock)."""
    return event_ms(lambda: model.sync_free_step(graph.ids, graph.pos, graph.cache, layers), steps)


def run(args: argparse.Namespace) -> None:
    model = load_model(args, args.prompt_len + args.new_tokens + 64)
    device = model.device
    with tempfile.TemporaryDirectory() as tmp:
        print("writing a random drafter at the target's shapes", file=sys.stderr, flush=True)
        write_drafter(Path(tmp) / "dspark", model.config, seed=0)
        drafter = load_drafter(Path(tmp) / "dspark", model)
    seeded = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.text.vocab_size, (args.prompt_len,), generator=seeded)
    print(f"speculative generation of {args.new_tokens} tokens after a {args.prompt_len}-token prompt",
          file=sys.stderr, flush=True)
    greedy = SamplingParams(temperature=0.0)
    decoder = SpeculativeDecoder(model, drafter)
    seqs, stats = decoder.generate([prompt.tolist()], max_new_tokens=args.new_tokens, sampling=greedy)
    layers = tuple(sorted(drafter.capture_layer_ids))
    T = drafter.block_size + 1
    captured = getattr(model, "captured", None)
    verify = None if captured is None else captured.graphs.get(((1, T), layers))
    if verify is None:
        raise BenchmarkError(f"--fast {args.fast}: the loop replayed no verify step of {T} tokens (raise --new-tokens)")
    timed_steps = stats.decode_steps - 1
    if timed_steps < 1:
        raise BenchmarkError("the loop stopped after its first step: raise --new-tokens")
    verify_ms = replay_time(verify, args.steps)
    launched_ms = launched_time(model, verify, layers, args.steps)
    print("capturing the plain decode step", file=sys.stderr, flush=True)
    ids, pos = verify.ids[:, :1].clone(), verify.pos[:, :1].clone()
    with torch.no_grad():
        model.step(ids, pos, verify.cache)
    plain_ms = replay_time(model.captured.graphs[(1, 1)], args.steps)
    # the drafter's pass alone, after the loop's last step: its anchor is the last token, at the committed length
    anchors = torch.tensor([seqs[0].generated[-1]], device=device)
    t = torch.tensor(decoder.lengths, device=device)

    def draft() -> None:
        drafter.draft(model, decoder.draft_cache, anchors, t, drafter.block_size, greedy, None)

    draft_ms = event_ms(draft, args.steps)
    result = {"bench": "speculative_decode", "preset": args.preset, "layers": len(model.layers),
              "experts": args.experts, "fast": args.fast, "prompt_len": args.prompt_len,
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "drafter_layers": drafter.config.num_hidden_layers, "verify_tokens": T,
              "verify_replay_ms": round(verify_ms, 3), "verify_launched_ms": round(launched_ms, 3),
              "graph_speedup": round(launched_ms / verify_ms, 3), "plain_step_ms": round(plain_ms, 3),
              "verify_in_plain_steps": round(verify_ms / plain_ms, 3),
              "draft_ms": round(draft_ms, 3),
              "loop_verify_ms_per_step": round(1e3 * stats.verify_seconds / timed_steps, 3),
              "loop_draft_ms_per_step": round(1e3 * stats.draft_seconds / timed_steps, 3),
              "stats": stats.as_dict()}
    if args.profile:
        from prefill import profile_prefill

        result["profile_verify_replay"] = profile_prefill(device, lambda: verify.graph.replay(), args.top)
        result["profile_draft"] = profile_prefill(device, draft, args.top)
    emit(result, args.out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return main_guard(lambda: run(args), [])


if __name__ == "__main__":
    sys.exit(main())
