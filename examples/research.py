#!/usr/bin/env python
"""Research with minimax-ref, notebook-style: expert usage, a logit lens, an expert ablation, MSA block selection.

    python examples/research.py                      # the embedded default checkpoint, on the CPU
    python examples/research.py --ckpt-path DIR --device cuda --out research_out

Every step uses the public API only: `mr.score(..., trace=)` records a right-padded batch into a `Trace` (its
`mask` marks real tokens), `Trace.expert_counts` / `logit_lens` / `blocks` read it, and `Interventions` edits a
forward at its hook points. The MSA picture is written as a PNG with matplotlib when it is installed (else
Pillow, else only the text summary is printed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import minimax_ref as mr

PAIRS = [
    ("What is 17 * 23?", " 17 * 23 = 391."),
    ("The weather in Lisbon today is", " sunny with a light breeze."),
    ("def add(a, b):\n", "    return a + b\n"),
    ("The capital of France is", " Paris, on the Seine."),
    ("Order 48213 ships from", " the Rotterdam warehouse on Monday."),
    ("Once upon a time", " there was a small robot that counted stars."),
]


def histogram(counts: torch.Tensor, width: int = 40) -> str:
    """One text bar per expert, scaled to the largest count."""
    top = max(1, int(counts.max()))
    return "\n".join(f"    expert {e:3d} {int(c):6d} {'#' * round(width * int(c) / top)}" for e, c in enumerate(counts))


def usage(model, tok) -> dict[int, torch.Tensor]:
    """Expert-usage histogram per MoE layer over the real tokens of every pair (padding excluded)."""
    trace = mr.Trace(layers=set())
    mr.score(model, tok, PAIRS, trace=trace)
    counts = {L: trace.expert_counts(L) for L in sorted(trace.routing)}
    for L, c in counts.items():
        print(f"  layer {L}: {int(c.sum())} (token, slot) choices over {int(trace.mask.sum())} tokens")
        print(histogram(c))
    return counts


def logit_lens(model, tok, prompt: str) -> None:
    """Each layer's top prediction for the token after `prompt`."""
    ids = torch.tensor([tok.encode(prompt)], device=model.device)
    trace = mr.Trace()
    with torch.no_grad():
        model(ids, trace=trace)
        lens = trace.logit_lens(model)
    print(f"  prompt {prompt!r}")
    for L, logits in lens.items():
        p = torch.softmax(logits[0, -1], -1)
        top = torch.topk(p, 3)
        guesses = ", ".join(f"{tok.decode([int(i)])!r} {float(q):.2f}" for q, i in zip(top.values, top.indices))
        print(f"    after layer {L}: {guesses}")


def ablation(model, tok, layer: int, expert: int) -> dict:
    """Zero one expert's output in one layer; drift and top-1 agreement against the unedited model."""
    base = mr.score(model, tok, PAIRS)
    edit = mr.Interventions(expert_scale={layer: {expert: 0.0}})
    ablated = mr.score(model, tok, PAIRS, trace=mr.Trace(layers=set(), interventions=edit))
    d = ablated.drift(base)
    print(f"  zeroing expert {expert} of layer {layer}: drift {d['drift_1e3']:+.1f} ± {d['drift_stderr_1e3']:.1f} "
          f"x1e-3 nats/token, top-1 agreement {100 * d['top1_agreement']:.1f} % over {d['tokens']} tokens")
    return d


def block_pattern(model, tok, out: Path) -> Path | None:
    """Which key blocks each query of a long text selects in the first MSA layer (kv head 0), as a picture."""
    text = " ".join(f"Order {40000 + 7 * i} ships from warehouse {i % 5} on day {i % 7}." for i in range(30))
    ids = torch.tensor([tok.encode(text)], device=model.device)[:, : model.max_seq_len]
    trace = mr.Trace(layers=set())
    with torch.no_grad():
        model(ids, trace=trace)
    if not trace.blocks:
        print("  this model has no MSA layer")
        return None
    L = min(trace.blocks)
    blocks = trace.blocks[L][0, 0]  # [T, kb], -1 = empty slot
    T, n_blocks = blocks.shape[0], -(-blocks.shape[0] // model.text.sparse.block_size)
    picture = torch.zeros(T, n_blocks)
    rows = torch.arange(T)[:, None].expand_as(blocks)
    kept = blocks >= 0
    picture[rows[kept], blocks[kept].long().cpu()] = 1.0
    print(f"  layer {L}: {T} queries x {n_blocks} key blocks of {model.text.sparse.block_size}; the last query "
          f"reads blocks {sorted(blocks[-1][blocks[-1] >= 0].tolist())}")
    path = out / f"msa_blocks_layer{L}.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 6))
        ax.imshow(picture.numpy(), aspect="auto", cmap="Greys", interpolation="nearest")
        ax.set(xlabel="key block", ylabel="query position", title=f"MSA block selection, layer {L}, kv head 0")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
    except ImportError:
        try:
            from PIL import Image
        except ImportError:
            print("  (install matplotlib or Pillow for the PNG)")
            return None
        scale = max(1, 256 // n_blocks)
        img = (255 - 255 * picture).to(torch.uint8).repeat_interleave(scale, 1)
        Image.fromarray(img.numpy(), mode="L").save(path)
    print(f"  wrote {path}")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-path", default=None, help="checkpoint folder (default: the embedded nano model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("research_out"), help="folder for the PNG")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = mr.load_model(args.ckpt_path, device=args.device, dtype=torch.float32)
    tok = mr.load_tokenizer(args.ckpt_path)
    print(model.config)

    print("\n== expert usage per layer")
    counts = usage(model, tok)
    print("\n== logit lens")
    logit_lens(model, tok, "The capital of France is")
    print("\n== ablation: the most used expert of the middle MoE layer")
    layer = sorted(counts)[len(counts) // 2]
    ablation(model, tok, layer, int(counts[layer].argmax()))
    print("\n== MSA block selection")
    block_pattern(model, tok, args.out)


if __name__ == "__main__":
    main()
