"""Optional stage: train a DSpark drafter for a nano checkpoint and add it as `<ckpt>/dspark/`.

    python examples/nano/train_drafter.py --ckpt-path nano-ckpt --device cuda --minutes 3
    minimax-ref generate --ckpt-path nano-ckpt --chat --speculative dspark --prompt "What is 17*23?"

The drafter is the engine's `minimax_ref.generation.drafter.DSparkDrafter` (its modules, no second copy), sized
by `synth.drafter_config_json` for the target with a block of 7 (--block) and one dense layer.
The target is the exported checkpoint itself, loaded with `minimax_ref.load_model`, frozen: the
drafter learns what the deployed (quantized) model does.

Training (self-distillation on the nano model's own outputs): training-distribution rows go through
the target once (no gradient), which gives the residual streams of `dspark_target_layer_ids` (the
drafter's context) and the target's greedy next token at every position. For anchors t sampled in the
assistant turns, the block `[token t, noise x (B-1)]` at positions t..t+B-1 attends to its own keys
and to context rows at positions < t inside the sliding window (`DraftDecoderLayer` with the
engine's `block_attention`); block position k learns the target's greedy token for position t+k+1,
through base logits (the target's LM head on the drafter's final norm) plus the Markov bias of the
previous target token (teacher forcing), and the confidence head learns whether that draft is right.

Export: the release's `dspark/` layout (`drafter.drafter_tensor_table` names), layers MXFP8 with
`weight_scale_inv`, `fc`, norms, Markov and confidence heads bf16, no embedding and no LM head.
Check: greedy speculative decoding with the exported drafter must give the same tokens as plain
greedy decoding; the mean accepted length is reported and stored in `nano_run.json` ("drafter").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `examples.nano` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from examples.nano import data as nd
from examples.nano import export as nx
from examples.nano import train as nt
from minimax_ref.generation.drafter import SUBFOLDER, DSparkDrafter, drafter_tensor_table, load_drafter
from minimax_ref.model.config import parse_drafter_config
from minimax_ref.model.decoder import MiniMaxM3
from minimax_ref.model.norm import RMSNorm
from minimax_ref.research.trace import Trace
from minimax_ref.weights.synth import drafter_config_json


def target_layer_ids(n_layers: int, k: int = 3) -> list[int]:
    """k target layers, every other one counted back from the last (the release spreads 5 over 60)."""
    return sorted({max(0, n_layers - 1 - 2 * i) for i in range(k)})


def drafter_raw_config(target: MiniMaxM3, noise_id: int, block: int, layers: int, ffn: int, window: int,
                       rank: int) -> dict[str, Any]:
    raw = drafter_config_json(target.config, num_layers=layers, block_size=block, noise_token_id=noise_id,
                              target_layer_ids=target_layer_ids(target.text.num_hidden_layers),
                              sliding_window=window, markov_rank=rank)
    # a smaller FFN than the target's dense MLP keeps the drafter a few MB
    raw["text_config"]["dspark_ffn_hidden_size"] = raw["text_config"]["dense_intermediate_size"] = ffn
    return raw


def init_drafter(drafter: DSparkDrafter, seed: int, std: float = 0.02) -> list[torch.nn.Parameter]:
    """Linears N(0, std^2) (o_proj / down_proj / fc scaled down), norm offsets 0, markov_w1 N(0, 1),
    markov_w2 0 (the Markov bias starts at zero: the first drafts are the base logits), confidence
    head N(0, std^2) and bias 0. Returns the parameters, made trainable."""
    g = torch.Generator().manual_seed(seed)
    n = max(1, len(drafter.layers))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            owner = drafter.get_submodule(name.rpartition(".")[0])
            if isinstance(owner, RMSNorm) or name.endswith("bias"):
                p.zero_()
            elif name.endswith("markov_w1.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("markov_w2.weight"):
                p.zero_()
            else:
                s = std / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
            p.requires_grad_(True)
    return list(drafter.parameters())


def continue_from(drafter: DSparkDrafter, path: Path, target: MiniMaxM3) -> None:
    """Copy the weights of the exported drafter `path` (decoded by `drafter.load_drafter`, as inference reads
    them) into `drafter`, which keeps its trainable parameters."""
    if not (Path(path) / "config.json").is_file():
        raise SystemExit(f"--init {path}: not a dspark/ folder (no config.json)")
    old = load_drafter(path, target).state_dict()
    own = drafter.state_dict()
    wrong = sorted(k for k in own if k not in old or old[k].shape != own[k].shape)
    if wrong or set(old) - set(own):
        raise SystemExit(f"--init {path}: another drafter shape ({len(wrong)} tensors differ, e.g. {wrong[:3]}); "
                         "give the --block/--layers/--ffn/--window/--rank it was trained with")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(old[k].to(v.dtype))


def sample_anchors(labels: torch.Tensor, per_row: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) of up to `per_row` anchors per row: positions t whose next token is a target
    of the language-model loss (assistant turns and plain text)."""
    rows, ts = [], []
    for b in range(labels.shape[0]):
        cand = (labels[b] != -100).nonzero().flatten()
        if cand.numel() == 0:
            continue
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:per_row]]
        rows.append(torch.full_like(pick, b))
        ts.append(pick)
    return torch.cat(rows), torch.cat(ts)


def drafter_loss(drafter: DSparkDrafter, target: MiniMaxM3, batch: dict[str, Any], device: torch.device,
                 per_row: int, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one batch: cross-entropy of every block position against the target's greedy token,
    plus 0.1 x the confidence head's binary cross-entropy. Also returns per-position accuracy and the
    accepted length a greedy verifier would give on these anchors (leading right drafts + 1)."""
    ids = batch["input_ids"].to(device)
    labels = batch["labels"].to(device)
    B, T = ids.shape
    Bk = drafter.block_size
    with torch.no_grad():
        trace = Trace(layers=drafter.capture_layer_ids)
        x = nt.input_embeddings(target, ids, batch["pixel_values"], batch["image_grid_thw"])
        greedy = target(ids, inputs_embeds=x, trace=trace).argmax(-1)  # token the target writes at p + 1
    rows, ts = sample_anchors(labels, per_row, generator)
    rows, ts = rows.to(device), ts.to(device)
    c = drafter.hidden_norm(drafter.fc(drafter.context_features(target, trace.hidden_states)))  # [B, T, H]
    ctx_pos = torch.arange(T, device=device)
    cos_c, sin_c = drafter._rope(ctx_pos.expand(B, T))
    q_pos = ts[:, None] + torch.arange(Bk, device=device)
    cos, sin = drafter._rope(q_pos)
    block = torch.full((rows.numel(), Bk), drafter.config.noise_token_id, dtype=torch.long, device=device)
    block[:, 0] = ids[rows, ts]
    h = target.embed(block).to(drafter.dtype)
    for layer in drafter.layers:
        k_ctx, v_ctx = layer.self_attn.context_kv(c, cos_c, sin_c)
        h = layer(h, q_pos, cos, sin, k_ctx[rows], v_ctx[rows], ctx_pos, ts)
    h = drafter.final_norm(h)
    base = target.lm_head(h.to(target.dtype)).float()  # [A, Bk, V]
    at = q_pos.clamp(max=T - 1)
    want = greedy[rows[:, None], at]
    valid = (q_pos <= T - 1) & (labels[rows[:, None], at] != -100)
    prev = torch.cat((block[:, :1], want[:, :-1]), dim=1)
    bias, emb = drafter.markov_head.bias(prev)
    z = base + bias
    ce = F.cross_entropy(z.flatten(0, 1), want.flatten(), reduction="none").view_as(want)
    loss = (ce * valid).sum() / valid.sum().clamp_min(1)
    right = (z.argmax(-1) == want) & valid
    stats = {"ce": float(loss.detach())}
    if drafter.confidence_head is not None:
        feats = torch.cat((h, emb.to(h.dtype)), -1) if drafter.config.confidence_head_with_markov else h
        conf = drafter.confidence_head(feats).float().clamp(1e-6, 1 - 1e-6)
        # written out: autocast refuses F.binary_cross_entropy (the head ends in a sigmoid of its own)
        bce = -(right * conf.log() + (~right) * (1 - conf).log())
        loss = loss + 0.1 * (bce * valid).sum() / valid.sum().clamp_min(1)
    lead = torch.cumprod(right.long(), dim=1).sum(1).float()
    stats["acc_per_pos"] = [round(float(right[:, k].sum() / valid[:, k].sum().clamp_min(1)), 3) for k in range(Bk)]
    stats["accept_len"] = float(lead.mean() + 1)
    return loss, stats


def export_drafter(drafter: DSparkDrafter, raw: dict[str, Any], out_dir: Path) -> Path:
    """Write `dspark/` in the release layout: MXFP8 layers, bf16 fc / norms / heads, one shard + index."""
    out_dir.mkdir(parents=True, exist_ok=True)
    linears, plain = drafter_tensor_table(drafter.config)
    tensors: dict[str, torch.Tensor] = {}
    for spec in plain.values():
        tensors[spec.name] = drafter.get_parameter(spec.module).detach().cpu().bfloat16().contiguous()
    for prefix, spec in linears.items():
        w = drafter.get_submodule(spec.module).weight.detach().float().cpu()
        tensors.update(nx.encode_linear(prefix, w, "bf16" if prefix.endswith(".fc") else "mxfp8"))
    for old in out_dir.glob("model-*.safetensors"):
        old.unlink()
    save_file(tensors, str(out_dir / nx.SHARD), metadata={"format": "pt"})
    (out_dir / nx.SHARD).chmod(0o644)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: nx.SHARD for n in sorted(tensors)}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-path", type=Path, required=True, help="the nano checkpoint (gets a dspark/ folder)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=3.0, help="time budget of the training loop (default: 3)")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--init", type=Path, default=None,
                   help="a dspark/ folder to continue from (e.g. a drafter trained for an earlier stage of the same "
                        "model; its block, layers, MLP width, window and Markov rank must match the flags)")
    p.add_argument("--block", type=int, default=7, help="dspark_block_size (default: 7, the release's)")
    p.add_argument("--layers", type=int, default=1, help="draft layers (default: 1)")
    p.add_argument("--ffn", type=int, default=512, help="draft MLP width (default: 512)")
    p.add_argument("--window", type=int, default=512, help="sliding window over the context (default: 512)")
    p.add_argument("--rank", type=int, default=32, help="Markov head rank (default: 32)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default: the nano size's)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--anchors", type=int, default=32, help="anchors per row (default: 32)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--check-prompts", type=int, default=16, help="prompts of the speculative check")
    return p.parse_args(argv)


def train_drafter(args: argparse.Namespace) -> dict[str, Any]:
    import minimax_ref as mr

    device = torch.device(args.device)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(args.seed)
    ckpt = Path(args.ckpt_path)
    run_path = ckpt / "nano_run.json"
    run = json.loads(run_path.read_text(encoding="utf-8")) if run_path.is_file() else {}
    size = nt.SIZES[run.get("size", "nano")]
    heldout = nd.Heldout.from_json(run["heldout"]) if "heldout" in run else nd.make_heldout(args.seed)
    target = mr.load_model(ckpt, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    tok = mr.load_tokenizer(ckpt)
    raw = drafter_raw_config(target, tok.special_ids.dspark_noise, args.block, args.layers, args.ffn, args.window,
                             args.rank)
    dcfg = parse_drafter_config(raw, target.text)
    drafter = DSparkDrafter(dcfg, target.text.num_hidden_layers).to(device)
    params = init_drafter(drafter, args.seed)
    if args.init is not None:
        continue_from(drafter, args.init, target)
    n_params = sum(p.numel() for p in params)
    print(f"drafter: {n_params / 1e6:.2f}M parameters, block {dcfg.block_size}, {dcfg.num_hidden_layers} layer(s), "
          f"target layers {list(dcfg.target_layer_ids)}, window {dcfg.sliding_window}", flush=True)
    workers = args.workers if args.workers is not None else (8 if device.type == "cuda" else 0)
    loader = torch.utils.data.DataLoader(
        nt.BatchStream(ckpt, heldout, None, False, nd.find_fonts("default"), args.seed + 1,
                       args.seq_len or size.seq_len, args.batch or size.batch),
        batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
        prefetch_factor=4 if workers else None, persistent_workers=workers > 0)
    batches = iter(loader)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    amp = "bf16" if device.type == "cuda" else "none"
    g = torch.Generator().manual_seed(args.seed)
    budget, step, t0 = args.minutes * 60.0, 0, time.time()
    drafter.train()
    while True:
        progress = max(step / args.steps, (time.time() - t0) / budget)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        with nt.autocast(device, amp):
            loss, stats = drafter_loss(drafter, target, next(batches), device, args.anchors, g)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.log_every == 0 or step == 1:
            print(f"step={step} loss={float(loss.detach()):.4f} ce={stats['ce']:.4f} "
                  f"accept_len={stats['accept_len']:.2f} acc_per_pos={stats['acc_per_pos']} lr={lr:.2e} "
                  f"elapsed_s={int(time.time() - t0)}", flush=True)
    out = export_drafter(drafter, raw, ckpt / SUBFOLDER)

    # check: greedy speculative decoding with the exported drafter equals plain greedy decoding
    loaded = load_drafter(out, target)
    rng = random.Random("nano-drafter-check")
    prompts = [nd.arithmetic_question(*p, rng) for p in heldout.arithmetic[: args.check_prompts // 2]]
    prompts += [nd.weather_request(c, 3, rng) for c in heldout.cities[: args.check_prompts - len(prompts)]]
    kw = dict(chat=True, tools=nd.TOOLS, max_new_tokens=128, temperature=0.0)
    plain = mr.generate(target, tok, prompts, **kw)
    spec = mr.generate(target, tok, prompts, draft=loaded, **kw)
    summary = {"parameters": n_params, "steps": step, "block": dcfg.block_size, "layers": dcfg.num_hidden_layers,
               "target_layer_ids": list(dcfg.target_layer_ids), "bytes": nx.folder_bytes(out),
               "greedy_identical": all(a.token_ids == b.token_ids for a, b in zip(plain, spec)),
               "mean_accepted_length": spec[0].stats.get("mean_accepted_length"),
               "acceptance_rate_per_position": spec[0].stats.get("acceptance_rate_per_position")}
    print("drafter check:", json.dumps(summary), flush=True)
    if run:
        run["drafter"] = summary
        run_path.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return summary


def main(argv: list[str] | None = None) -> int:
    train_drafter(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
