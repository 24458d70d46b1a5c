"""Pretrain the nano vision tower and projector to read numbers, before the language model learns to use them.

    python examples/nano/pretrain_vision.py --device cuda --minutes 2.5 --out nano-run/vision   # 1 x H200
    python examples/nano/train.py --device cuda --init CKPT --vision-init nano-run/vision/vision.safetensors ...
    python examples/nano/pretrain_vision.py --device cpu --steps 20 --batch 16 --out /tmp/vision  # CPU smoke run

Why a stage of its own: trained only through the language model, the tower never learned (two stages of
about 15k and 80k images: the projected features grew or were pushed to a constant, and the teacher-forced
image answers stayed at the text prior). A ViT of 1M parameters learning to read from scratch needs far more
images than the language-model batches carry (about 100 images per step, each inside a 2,048-token row),
and its gradient reaches it only through a language model that has learned to ignore image tokens. Here the
engine's `VisionTower` and `Projector` (the modules `MiniMaxM3` builds, initialised by `train.init_weights`)
are trained on their own, a few hundred images per step, through a small readout head that exists only in
this script: four learned queries attend over the projected tokens of one image (no positions, so the
features themselves must say which digit is first, second, ...) and each classifies its place into a digit
or "none". The language-model stage then starts from features that carry the number.

Data: the training-distribution number images of `data.py` (held-out numbers excluded), rendered by the data
workers; the images of a batch are sorted by patch count so that the tower's attention runs equal-length
images together (`vision.equal_length_runs`). Loss: cross-entropy over the four places, plus
`--feature-l2` times the projected features' mean square (it keeps their scale near the text embeddings').

Writes OUT/vision.safetensors (`vision_tower.*`, `projector.*`, float32, the engine's names) and
OUT/vision_run.json (run summary, evaluation on held-out numbers and on the seed's 427 image).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.nano` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch import nn

from examples.nano import data as nd
from examples.nano.train import init_weights
from minimax_ref.model.config import parse_model_config
from minimax_ref.model.decoder import MiniMaxM3
from minimax_ref.model.vision import tokens_per_image
from minimax_ref.weights.embedded import default_checkpoint

PLACES = 4  # the data's numbers have 1 to 4 digits
NONE = 10  # the class of a place past the number's last digit


def place_targets(numbers: list[int]) -> torch.Tensor:
    """`[len(numbers), PLACES]` long: the digits left to right, then NONE: 427 -> [4, 2, 7, 10]."""
    bad = [n for n in numbers if n < 0 or len(str(n)) > PLACES]
    if bad:
        raise ValueError(f"the readout reads numbers of 0 to {'9' * PLACES}; got {bad[:3]}")
    rows = [[int(c) for c in str(n)] + [NONE] * (PLACES - len(str(n))) for n in numbers]
    return torch.tensor(rows, dtype=torch.long)


def read_number(logits: torch.Tensor) -> list[str]:
    """The readout's numbers from `[B, PLACES, 11]` logits: digits up to the first NONE."""
    out = []
    for row in logits.argmax(-1).tolist():
        digits = row[:row.index(NONE)] if NONE in row else row
        out.append("".join(str(d) for d in digits))
    return out


class Readout(nn.Module):
    """Training-only head: `PLACES` learned queries attend over one image's projected tokens, and each place
    has a classifier of its own. (With one classifier shared by the places, the places differ only through
    the attention, which starts uniform: the head then fits the prior and learns nothing for a long time.)"""

    def __init__(self, dim: int, width: int = 128):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(PLACES, width) * width**-0.5)
        self.key = nn.Linear(dim, width)
        self.value = nn.Linear(dim, width)
        self.hidden = nn.Linear(width, width)
        self.classify = nn.Parameter(torch.randn(PLACES, width, NONE + 1) * width**-0.5)
        self.bias = nn.Parameter(torch.zeros(PLACES, NONE + 1))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens `[sum(counts), dim]` (images back to back) -> logits `[len(counts), PLACES, 11]`."""
        padded = nn.utils.rnn.pad_sequence(list(F.rms_norm(tokens.float(), (tokens.shape[-1],)).split(counts)),
                                           batch_first=True)  # [B, T, dim]
        lengths = torch.tensor(counts, device=tokens.device)
        keep = torch.arange(padded.shape[1], device=tokens.device)[None] < lengths[:, None]  # [B, T]
        scores = torch.einsum("pw,btw->bpt", self.queries, self.key(padded)) * self.queries.shape[-1] ** -0.5
        weights = scores.masked_fill(~keep[:, None], float("-inf")).softmax(-1)
        pooled = F.gelu(self.hidden(torch.einsum("bpt,btw->bpw", weights, self.value(padded))))
        return torch.einsum("bpw,pwc->bpc", pooled, self.classify) + self.bias


class ImageBatches(torch.utils.data.IterableDataset):
    """Endless batches of training-distribution number images: (pixel_values, grid_thw, targets, numbers),
    sorted by patch count; each data worker draws its own stream."""

    def __init__(self, heldout: nd.Heldout, fonts: tuple[str, ...], seed: int, batch: int):
        self.heldout, self.fonts, self.seed, self.batch = heldout, fonts, seed, batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]]:
        info = torch.utils.data.get_worker_info()
        rng = random.Random(f"nano-vision-{self.seed}-{0 if info is None else info.id}")
        gen = nd.TaskGenerator(self.heldout, {"image": 1.0}, None, self.fonts)
        while True:
            specs = [nd.random_image_spec(gen.train_image_number(rng), rng, self.fonts) for _ in range(self.batch)]
            yield image_batch(specs)


def image_batch(specs: list[nd.ImageSpec]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    specs = sorted(specs, key=lambda s: nd.PREPROCESSOR.num_tokens_for_size(s.height, s.width))
    pixel_values, grid = nd.PREPROCESSOR([s.render() for s in specs])
    numbers = [s.number for s in specs]
    return pixel_values, grid, place_targets(numbers), numbers


def eval_sets(heldout: nd.Heldout, fonts: tuple[str, ...], seed: int, n: int) -> dict[str, tuple]:
    """Held-out numbers rendered like training images, and the seed's check image (427, clean)."""
    rng = random.Random(f"nano-vision-eval-{seed}")
    numbers = [heldout.image_numbers[i % len(heldout.image_numbers)] for i in range(n)]
    return {"heldout": image_batch([nd.random_image_spec(x, rng, fonts) for x in numbers]),
            "seed_427": image_batch([nd.seed_image_spec()])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for vision.safetensors and vision_run.json")
    p.add_argument("--config", type=Path, default=None,
                   help="checkpoint folder whose config.json gives the model shape (default: the shipped default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=2.5, help="time budget of the training loop (default: 2.5)")
    p.add_argument("--steps", type=int, default=1_000_000, help="most optimizer steps (default: no limit)")
    p.add_argument("--batch", type=int, default=512, help="images per step (default: 512)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps (default: 100)")
    p.add_argument("--feature-l2", type=float, default=1e-3, help="weight of the features' mean square (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None,
                   help="data worker processes (default: cores - 2 on CUDA, 0 on CPU)")
    p.add_argument("--fonts", choices=["default", "builtin"], default="default",
                   help="font files found on the machine plus the embedded one (default), or the embedded one only")
    p.add_argument("--eval-images", type=int, default=512)
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(tower: nn.Module, projector: nn.Module, head: Readout, sets: dict[str, tuple],
             device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (pv, grid, targets, numbers) in sets.items():
        tokens = projector(tower(pv.to(device), grid))
        logits = head(tokens, tokens_per_image(grid, projector.merge))
        read = read_number(logits)
        out[name] = {"exact": sum(r == str(n) for r, n in zip(read, numbers)) / len(numbers),
                     "place_acc": float((logits.argmax(-1).cpu() == targets).float().mean())}
        if len(numbers) == 1:
            out[name]["read"] = read[0]
    return out


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    workers = args.workers if args.workers is not None else (
        max(1, (os.cpu_count() or 2) - 2) if device.type == "cuda" else 0)
    config_dir = args.config or default_checkpoint()
    cfg = parse_model_config(json.loads((Path(config_dir) / "config.json").read_text()))
    if cfg.vision is None:
        raise SystemExit(f"{config_dir}/config.json has no vision_config: nothing to pretrain")
    model = MiniMaxM3(cfg)
    init_weights(model, args.seed)  # the tower and projector start exactly as in a fresh train.py run
    tower, projector = model.vision_tower.to(device), model.projector.to(device)
    head = Readout(cfg.text.hidden_size).to(device)
    params = [p for m in (tower, projector, head) for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    heldout = nd.make_heldout(args.seed)
    fonts = nd.find_fonts(args.fonts)
    sets = eval_sets(heldout, fonts, args.seed, args.eval_images)
    loader = torch.utils.data.DataLoader(ImageBatches(heldout, fonts, args.seed, args.batch), batch_size=None,
                                         num_workers=workers, pin_memory=device.type == "cuda",
                                         prefetch_factor=4 if workers else None, persistent_workers=workers > 0)
    args.out.mkdir(parents=True, exist_ok=True)
    log = []
    budget, step, images = args.minutes * 60.0, 0, 0
    acc_loss = acc_ms = 0.0
    t_train = time.time()
    print(f"vision pretraining: {sum(p.numel() for p in params) / 1e6:.2f}M parameters (tower, projector, readout), "
          f"{args.batch} images per step, {len(fonts)} fonts, {workers} workers", flush=True)
    for pv, grid, targets, _ in loader:
        progress = max(step / args.steps, (time.time() - t_train) / budget)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            tokens = projector(tower(pv.to(device, non_blocking=True), grid))
            logits = head(tokens, tokens_per_image(grid, projector.merge))
        ms = tokens.float().square().mean()
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten())
        (loss + args.feature_l2 * ms).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        images += len(targets)
        acc_loss += float(loss.detach())
        acc_ms += float(ms.detach())
        if step % args.log_every == 0:
            n = args.log_every
            record = {"step": step, "loss": round(acc_loss / n, 4), "feature_rms": round(math.sqrt(acc_ms / n), 3),
                      "lr": f"{lr:.2e}", "images/s": int(images / (time.time() - t_train)),
                      "elapsed_s": int(time.time() - t_train)}
            if step % (4 * args.log_every) == 0:
                record["eval"] = evaluate(tower, projector, head, sets, device)
            log.append(record)
            print(" ".join(f"{k}={v}" for k, v in record.items()), flush=True)
            acc_loss = acc_ms = 0.0
    final = evaluate(tower, projector, head, sets, device)
    print(f"final: {json.dumps(final)}", flush=True)
    from safetensors.torch import save_file

    state = {f"vision_tower.{k}": v for k, v in tower.state_dict().items()}
    state |= {f"projector.{k}": v for k, v in projector.state_dict().items()}
    save_file({k: v.detach().float().cpu().contiguous() for k, v in state.items()},
              str(args.out / "vision.safetensors"))
    summary = {"steps": step, "images": images, "train_seconds": round(time.time() - t_train, 1),
               "total_seconds": round(time.time() - t_start, 1), "batch": args.batch, "peak_lr": args.lr,
               "feature_l2": args.feature_l2, "seed": args.seed, "fonts": list(fonts), "device": str(device),
               "torch": torch.__version__, "eval": final, "log": log}
    (args.out / "vision_run.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    pretrain(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
