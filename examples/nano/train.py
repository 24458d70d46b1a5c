"""Train the nano MiniMax-M3 with the engine's own model definition and export it in the release format.

    python examples/nano/train.py --device cuda --minutes 12 --out nano-ckpt          # the H200 run
    python examples/nano/train.py --size micro --device cpu --steps 20 --out /tmp/micro  # CPU smoke run

Stages (each prints what it did):

1. data: the held-out split (`data.make_heldout(seed)`), the task generator, and a byte-level BPE
   tokenizer trained on generated text with the release's special tokens (`tokenizer.py`);
2. model: `minimax_ref.model.decoder.MiniMaxM3` built from a raw-form config (`export.raw_config`, the
   spelling `synth` writes), initialised here (`init_weights`) and made trainable (the engine builds
   inference parameters with `requires_grad=False`; flipping the flag is all it takes);
3. training: AdamW, linear warm-up then cosine decay over the run's progress (the larger of
   step / --steps and elapsed / --minutes, so the schedule ends when the time budget does), bf16
   autocast on GPU, packed sequences with loss on assistant turns only, images through the engine's
   vision tower and projector. Around the engine's forward the script adds what training needs and
   inference does not:
   * the lightning indexer gets no gradient from the LM loss (block selection is a top-k), so it is
     trained with a KL loss towards the attention distribution of its kv-head group on sampled
     queries, with its input detached (DeepSeek's sparse-attention recipe); for the first
     --dense-warmup of the run the sparse layers attend densely (`Attention.sparse` switched off) while
     the indexer learns;
   * the routers' selection bias `e_score_correction_bias` gets no gradient either (it only chooses):
     it follows the auxiliary-loss-free balancing rule, `bias += rate * sign(mean load - load)`;
   * images: the vision tower and projector can start from `pretrain_vision.py` (--vision-init); trained
     only through the language model from scratch, they did not learn in the minutes of a run;
   * from --qat-start on, weights are fake-quantized in the forward exactly as the export will store
     them (NVFP4 routed experts, MXFP8 other text linears; straight-through gradients), so the
     exported checkpoint computes what was trained;
4. export: NVFP4 `input_scale`s calibrated (amax of each expert's inputs / (6 * 448)), the checkpoint
   written with the engine's encoders (`export.py`), then loaded back with `minimax_ref.load_model`
   and checked: teacher-forced accuracy of the quantized checkpoint next to the trained model's, and a
   few generations.

The checkpoint folder (--out) holds only what the release holds plus `nano_run.json` (run summary and
held-out split). Logs, the held-out split, the tokenizer and the fp32 weights go to --run-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from torch.nn.utils import parametrize

from examples.nano import data as nd
from examples.nano import export as nx
from examples.nano.tokenizer import train_tokenizer
from minimax_ref.fast import FastPaths, apply
from minimax_ref.generation.tokenizer import load_tokenizer
from minimax_ref.model.attention import Attention
from minimax_ref.model.config import parse_model_config
from minimax_ref.model.decoder import MiniMaxM3, Numerics
from minimax_ref.model.linear import Linear
from minimax_ref.model.moe import Experts, Router
from minimax_ref.model.msa import index_scores
from minimax_ref.model.norm import RMSNorm
from minimax_ref.model.rope import apply_rope
from minimax_ref.research.trace import Trace
from minimax_ref.weights.checkpoint import tensor_table
from minimax_ref.weights.quant import (
    E4M3_MAX,
    NVFP4_BLOCK,
    dequant_mxfp8,
    dequant_nvfp4,
    pack_fp4,
    quantize_mxfp8,
    round_to_e2m1,
)

# ----------------------------------------------------------------------------------------------
# sizes


def text_config(vocab: int, hidden: int, layers: int, n_dense: int, heads: int, kv: int, head_dim: int, rotary: int,
                expert_inter: int, shared_inter: int, dense_inter: int, experts: int, top_k: int, index_dim: int,
                block: int, topk_blocks: int, max_pos: int, theta: float) -> dict[str, Any]:
    """text_config keys (raw release spelling; `sparse_*` go to sparse_attention_config): the first
    `n_dense` layers dense attention + dense MLP, the rest MSA + MoE, as in the release."""
    freq = [0] * n_dense + [1] * (layers - n_dense)
    return {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "rotary_dim": rotary,
            "partial_rotary_factor": rotary / head_dim, "rope_theta": theta, "intermediate_size": expert_inter,
            "shared_intermediate_size": shared_inter, "dense_intermediate_size": dense_inter,
            "num_local_experts": experts, "num_experts_per_tok": top_k, "max_position_embeddings": max_pos,
            "moe_layer_freq": freq, "sparse_attention_freq": freq, "sparse_disable_index_value": freq,
            "sparse_num_index_heads": kv, "sparse_index_dim": index_dim, "sparse_block_size": block,
            "sparse_topk_blocks": topk_blocks}


def vision_config(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    return {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "projection_dim": hidden}


@dataclasses.dataclass(frozen=True)
class Size:
    """A model size and the training defaults that go with it."""

    text: dict[str, Any]
    vision: dict[str, Any]
    seq_len: int
    batch: int
    lr: float
    warmup: int
    tokenizer_examples: int
    eval_per_kind: int
    indexer_queries: int


SIZES: dict[str, Size] = {
    # 6 layers (2 dense + 4 MSA/MoE), 16 experts of 256 (top 4) + a shared expert, MSA blocks of 32 with
    # top-8: dense up to 256 tokens, sparse beyond (every tool prompt and every packed training row).
    "nano": Size(text_config(4096, 384, 6, 2, 8, 2, 64, 32, 256, 256, 1024, 16, 4, 64, 32, 8, 32768, 10000.0),
                 vision_config(128, 512, 4, 4), seq_len=2048, batch=16, lr=2e-3, warmup=200,
                 tokenizer_examples=20000, eval_per_kind=32, indexer_queries=256),
    # the CPU smoke size: every code path (dense and sparse layers, MoE, vision), seconds per step
    "micro": Size(text_config(1024, 64, 3, 1, 4, 2, 16, 8, 32, 32, 128, 4, 2, 16, 8, 2, 4096, 10000.0),
                  vision_config(32, 64, 1, 2), seq_len=2048, batch=1, lr=3e-3, warmup=5,
                  tokenizer_examples=1500, eval_per_kind=4, indexer_queries=32),
}


def count_parameters(cfg: Any) -> dict[str, int]:
    """Parameters per module family of the engine's name table (`checkpoint.tensor_table`), the total,
    and `active_text`: what one text token uses (top_k of the routed experts, no vision)."""
    linears, plain = tensor_table(cfg)
    out: dict[str, int] = {}
    for spec in linears.values():
        out[spec.family] = out.get(spec.family, 0) + spec.out_features * spec.in_features
    for spec in plain.values():
        out[spec.family] = out.get(spec.family, 0) + math.prod(spec.shape)
    out["total"] = sum(out.values())
    t = cfg.text
    routed = out.get("routed_expert", 0)
    out["active_text"] = (out["total"] - out.get("vision", 0) - out.get("projector", 0) - routed
                          + routed * t.num_experts_per_tok // max(1, t.num_local_experts))
    return out


# ----------------------------------------------------------------------------------------------
# initialisation and trainability


def init_weights(model: MiniMaxM3, seed: int, std: float = 0.02) -> None:
    """Initialise every parameter (the engine allocates them uninitialised): linears and embeddings
    N(0, std^2), residual-branch outputs (o_proj, down_proj, w2, vision out_proj / fc2) scaled by
    1/sqrt(2 * layers), Gemma norm offsets 0 (scale 1), vision LayerNorms 1 / 0, biases 0, routers
    N(0, (0.1/sqrt(H))^2) so that the first routing is near uniform, selection biases 0.

    The projector's four linears (no residual around them) get N(0, 1/fan_in): at std 0.02 the chain
    shrinks features and gradients about 40-fold, and a probe classifying single digits from the
    projected tower features did not learn at all (chance after 150 steps of 32 images, while the
    tower's own features reached 43 %); at 1/fan_in it learns."""
    g = torch.Generator().manual_seed(seed)
    text_layers = model.text.num_hidden_layers
    vision_layers = model.config.vision.num_hidden_layers if model.config.vision is not None else 1
    H = model.text.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            leaf = name.rpartition(".")[2]
            if isinstance(owner, RMSNorm) or leaf in ("bias", "e_score_correction_bias"):
                p.zero_()
            elif isinstance(owner, nn.LayerNorm):
                p.fill_(1.0)
            elif isinstance(owner, Router):
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 / math.sqrt(H)))
            else:
                s = std
                if name.startswith("projector."):
                    s = p.shape[-1] ** -0.5
                elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                    s = std / math.sqrt(2 * text_layers)
                elif name.endswith(("out_proj.weight", "fc2.weight")):
                    s = std / math.sqrt(2 * vision_layers)
                p.copy_(torch.randn(p.shape, generator=g) * s)


def copy_tokenizer(ckpt: Path, out_dir: Path) -> dict[str, int]:
    """Copy a checkpoint folder's tokenizer files to `out_dir`; returns its special-token ids by attribute
    name (what `train_tokenizer` returns)."""
    import shutil

    from examples.nano.tokenizer import TOKENIZER_FILES
    from minimax_ref.generation import chat
    from minimax_ref.generation.tokenizer import SPECIAL_TOKEN_TEXTS

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(ckpt) / name, out_dir / name)
    # The run renders its data with the project's (release-exact) format, whatever template --init shipped.
    (out_dir / "chat_template.jinja").write_text(chat.CHAT_TEMPLATE, encoding="utf-8")
    tok = load_tokenizer(out_dir)
    return {name: tok.token_to_id(text) for name, text in SPECIAL_TOKEN_TEXTS.items()}


def load_init(model: MiniMaxM3, ckpt: Path, reinit_vision: bool = False) -> None:
    """Continue from an exported checkpoint: its tensors decoded to fp32 (`load_model`), copied into
    `model` (the same configuration; every tensor must match). With `reinit_vision`, the vision tower
    and projector keep `model`'s fresh initialisation."""
    from minimax_ref.weights.loader import load_model

    state = load_model(ckpt, dtype=torch.float32).state_dict()
    if reinit_vision:
        state = {k: v for k, v in state.items() if not k.startswith(("vision_tower.", "projector."))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (reinit_vision and k.startswith(("vision_tower.", "projector.")))]
    if missing or unexpected:
        raise SystemExit(f"--init {ckpt}: not the same model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_vision(model: MiniMaxM3, path: Path) -> None:
    """The vision tower and projector from `pretrain_vision.py`'s `vision.safetensors` (every tensor of both
    modules, engine names, nothing else)."""
    from safetensors.torch import load_file

    if model.vision_tower is None:
        raise SystemExit(f"--vision-init {path}: this model has no vision tower")
    if not Path(path).is_file():
        raise SystemExit(f"--vision-init {path}: no such file (pretrain_vision.py writes OUT/vision.safetensors)")
    state = load_file(str(path))
    own = {f"{prefix}.{k}": v for prefix in ("vision_tower", "projector")
           for k, v in model.get_submodule(prefix).state_dict().items()}
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    wrong = [k for k in own.keys() & state.keys() if state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise SystemExit(f"--vision-init {path}: not this model's vision tower: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, other shapes {wrong[:5]}")
    model.load_state_dict(state, strict=False)


def make_trainable(model: nn.Module) -> list[nn.Parameter]:
    """Flip `requires_grad` on (the engine builds inference parameters without it). The routers'
    selection biases stay off: no loss reaches them, the balancing rule (`update_routing_bias`) moves them."""
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))
        if p.requires_grad:
            params.append(p)
    return params


def sparse_attentions(model: MiniMaxM3) -> list[Attention]:
    return [layer.self_attn for layer in model.layers if model.text.sparse_layers[layer.layer]]


def set_dense(model: MiniMaxM3, dense: bool) -> None:
    """Make the MSA layers attend densely (`Attention.sparse = False`, the engine's dense path) or
    sparsely again; the indexer still trains on the captured inputs either way."""
    for attn in sparse_attentions(model):
        attn.sparse = not dense


# ----------------------------------------------------------------------------------------------
# quantization-aware training


def fake_quant_weight(w: torch.Tensor, fmt: str, partner: torch.Tensor | None = None) -> torch.Tensor:
    """`w` decoded from the encoding the export writes, bit for bit what `load_model` will decode.

    "mxfp8": an [N, K] linear through `quantize_mxfp8` / `dequant_mxfp8`. "nvfp4": stacked experts
    [E, N, K], each expert with its own global scale from max(amax(w[e]), amax(partner[e])) when a
    partner is given (w3 for w1 and back: `export.nvfp4_pair_amax`), else amax(w[e]). For speed on
    GPU all experts are quantized at once: the steps of `quant.quantize_nvfp4` in its float32 order,
    with a per-expert global scale (tests check equality with the per-expert `quantize_nvfp4`), then
    the engine's `dequant_nvfp4`, which takes one `weight_scale_2` per expert.
    """
    if fmt == "mxfp8":
        return dequant_mxfp8(*quantize_mxfp8(w)).to(w.dtype)
    x = w.float()
    E, N, K = x.shape
    amax = x.abs().amax(dim=(1, 2))
    if partner is not None:
        amax = torch.maximum(amax, partner.float().abs().amax(dim=(1, 2)))
    scale_2 = torch.where(amax == 0, torch.ones_like(amax), amax / (6.0 * 448.0))
    blocks = x.reshape(E, N, K // NVFP4_BLOCK, NVFP4_BLOCK)
    t = blocks.abs().amax(-1) / (6.0 * scale_2)[:, None, None]
    t = torch.where(t == 0, torch.ones_like(t), t)
    block_scale = t.clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = block_scale.float() * scale_2[:, None, None]
    codes = round_to_e2m1(blocks / divisor.unsqueeze(-1)).reshape(E, N, K)
    return dequant_nvfp4(pack_fp4(codes), block_scale, scale_2).to(w.dtype)


class FakeQuant(nn.Module):
    """A parametrization: the forward sees the quantized weight, the gradient goes straight through."""

    def __init__(self, fmt: str, partner: Any = None):
        super().__init__()
        self.fmt = fmt
        self.partner = partner  # a callable returning the partner's raw weight (not a submodule)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            q = fake_quant_weight(w, self.fmt, None if self.partner is None else self.partner())
        return w + (q - w).detach()


def _raw(module: nn.Module, name: str) -> torch.Tensor:
    if parametrize.is_parametrized(module, name):
        return module.parametrizations[name].original
    return getattr(module, name)


def enable_qat(model: MiniMaxM3) -> int:
    """Fake-quantize what the export quantizes: routed experts NVFP4, every other text `Linear` but the
    LM head MXFP8 (vision and projector stay bf16). Returns the number of parametrized weights."""
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            for leaf, partner in (("w1", "w3"), ("w3", "w1"), ("w2", None)):
                fn = None if partner is None else (lambda m=module, p=partner: _raw(m, p))
                parametrize.register_parametrization(module, leaf, FakeQuant("nvfp4", fn))
                n += 1
        elif isinstance(module, Linear) and name != "lm_head":
            parametrize.register_parametrization(module, "weight", FakeQuant("mxfp8"))
            n += 1
    return n


def disable_qat(model: MiniMaxM3) -> None:
    """Remove the parametrizations, keeping the raw (unquantized) weights the export encodes."""
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)


# ----------------------------------------------------------------------------------------------
# forward pieces that training adds around the engine's model


def input_embeddings(model: MiniMaxM3, ids: torch.Tensor, pixel_values: torch.Tensor | None,
                     grid: torch.Tensor | None, stats: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Token embeddings with image features in place of the `<image>` tokens (row-major order), as
    `multimodal.embed_with_images` places them, but with gradients: that function encodes the
    images under `torch.no_grad()` (`vision.encode_images`), so here the engine's tower and projector
    modules are called directly. `stats["feature_ms"]` receives the features' mean square (fp32)."""
    x = model.embed(ids)
    if pixel_values is None:
        return x
    features = model.projector(model.vision_tower(pixel_values.to(x.device), grid))
    if stats is not None:
        stats["feature_ms"] = features.float().square().mean()
    slots = (ids == model.config.image_token_id).unsqueeze(-1)
    if int(slots.sum()) != features.shape[0]:
        raise RuntimeError(f"batch holds {int(slots.sum())} image tokens but the images give {features.shape[0]}")
    return x.masked_scatter(slots, features.to(x.dtype))


class IndexerCapture:
    """Forward pre-hooks on the MSA layers' attention: keep each call's input, positions and RoPE tables."""

    def __init__(self, model: MiniMaxM3):
        self.inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.handles = [attn.register_forward_pre_hook(self._hook(attn.layer)) for attn in sparse_attentions(model)]

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.inputs[layer] = args[:4]  # x, pos, cos, sin
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def indexer_kl(attn: Attention, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               n_queries: int, generator: torch.Generator) -> torch.Tensor:
    """KL(attention || indexer) for `n_queries` sampled query positions of one MSA layer.

    Target: the causal softmax attention of the layer's own q/k (computed with its modules, no
    gradient), averaged over the query heads that read each kv head: index head h selects blocks for
    kv head h. Prediction: softmax over keys of the engine's index scores (`msa.index_scores`) of
    queries and keys projected from the detached input, so only the indexer learns from this loss."""
    B, T, _ = x.shape
    x = x.detach()
    nq = min(n_queries, T)
    qi = torch.randperm(T, generator=generator)[:nq].sort().values.to(x.device)
    xq, cq, sq, pq = x[:, qi], cos[:, qi], sin[:, qi], pos[:, qi]
    Hq, Hkv, D = attn.n_heads, attn.n_kv, attn.head_dim
    with torch.no_grad():
        q = apply_rope(attn.q_norm(attn.q_proj(xq).view(B, nq, Hq, D)), cq, sq).float()
        k = apply_rope(attn.k_norm(attn.k_proj(x).view(B, T, Hkv, D)), cos, sin).float()
        s = torch.einsum("bqhgd,bkhd->bhgqk", q.view(B, nq, Hkv, Hq // Hkv, D), k) * attn.scale
        future = torch.arange(T, device=x.device)[None, None, None, None, :] > pq[:, None, None, :, None]
        target = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1).mean(2)  # [B, Hkv, nq, T]
    iq = apply_rope(attn.index_q_norm(attn.index_q_proj(xq).view(B, nq, Hkv, attn.index_dim)), cq, sq)
    ik = apply_rope(attn.index_k_norm(attn.index_k_proj(x).view(B, T, 1, attn.index_dim)), cos, sin)[:, :, 0]
    log_q = torch.log_softmax(index_scores(iq, ik, pq), dim=-1)  # [B, Hkv, nq, T], -inf at future keys
    log_q = log_q.masked_fill(future[:, :, 0], 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()


@torch.no_grad()
def update_routing_bias(model: MiniMaxM3, trace: Trace, rate: float) -> float:
    """Auxiliary-loss-free balancing: `bias += rate * sign(mean load - load)` per MoE layer (DeepSeek-V3).
    Returns the mean over layers of max load / mean load of this batch."""
    imbalance = []
    for layer, routing in trace.routing.items():
        gate = model.layers[layer].block_sparse_moe.gate
        E = gate.weight.shape[0]
        counts = torch.bincount(routing.expert_ids.flatten(), minlength=E).float()
        gate.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)
        imbalance.append(float(counts.max() / counts.mean().clamp_min(1e-9)))
    return sum(imbalance) / max(1, len(imbalance))


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    if amp == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: MiniMaxM3, batch: dict[str, Any], device: torch.device, trace: Trace | None = None,
            stats: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean next-token loss over targets, logits, labels) of a collated batch (call under autocast);
    `stats` receives `input_embeddings`' image-feature statistics."""
    ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    x = input_embeddings(model, ids, batch["pixel_values"], batch["image_grid_thw"], stats)
    logits = model(ids, inputs_embeds=x, trace=trace)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, logits, labels


# ----------------------------------------------------------------------------------------------
# data loading


class BatchStream(torch.utils.data.IterableDataset):
    """Endless collated training batches; each data worker draws its own example stream (`stream` =
    worker id), so a run is reproducible for a given seed and number of workers."""

    def __init__(self, tokenizer_dir: Path, heldout: nd.Heldout, mix: dict[str, float] | None, stdlib: bool,
                 fonts: tuple[str, ...], seed: int, seq_len: int, batch: int):
        super().__init__()
        self.args = (tokenizer_dir, heldout, mix, stdlib, fonts, seed, seq_len, batch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        tokenizer_dir, heldout, mix, stdlib, fonts, seed, seq_len, batch = self.args
        info = torch.utils.data.get_worker_info()
        if info is not None:
            torch.set_num_threads(1)
        tok = load_tokenizer(tokenizer_dir)
        gen = nd.TaskGenerator(heldout, mix, nd.StdlibText(heldout) if stdlib else None, fonts,
                               nd.pieces_for(mix, tok))
        stream = nd.training_stream(gen, tok, seed, stream=0 if info is None else info.id)
        packer = nd.Packer(stream, seq_len, pad_id=tok.special_ids.bod)
        while True:
            yield nd.collate([packer.row() for _ in range(batch)])


def eval_batches(gen: nd.TaskGenerator, tok: Any, n_per_kind: int, seed: int, rows: int = 16) -> list[dict]:
    """Teacher-forced evaluation batches: one held-out example per row, right-padded."""
    held = nd.eval_examples(gen, n_per_kind, seed)
    examples = [nd.tokenize_example(ex, tok) for ex in held]
    kinds = [ex.kind for ex in held]
    out = []
    for i in range(0, len(examples), rows):
        chunk = examples[i:i + rows]
        T = max(len(e.ids) for e in chunk)
        packed = [nd.PackedRow(e.ids + [tok.special_ids.bod] * (T - len(e.ids)), e.loss + [False] * (T - len(e.ids)),
                               [e.image] if e.image else [], [k]) for e, k in zip(chunk, kinds[i:i + rows])]
        out.append(nd.collate(packed))
    return out


@torch.no_grad()
def teacher_forced_eval(model: MiniMaxM3, batches: list[dict], device: torch.device, amp: str) -> dict[str, Any]:
    """Per kind: token accuracy on the completion and the share of examples whose whole completion
    is predicted right (argmax at every target position)."""
    stats: dict[str, list[float]] = {}
    for batch in batches:
        with autocast(device, amp):
            _, logits, labels = lm_loss(model, batch, device)
        mask = labels != -100
        right = (logits.argmax(-1) == labels) & mask
        for r, kinds in enumerate(batch["kinds"]):
            s = stats.setdefault(kinds[0], [0, 0, 0, 0])
            s[0] += int(right[r].sum())
            s[1] += int(mask[r].sum())
            s[2] += int(right[r].sum() == mask[r].sum())
            s[3] += 1
    return {k: {"token_acc": round(v[0] / max(1, v[1]), 4), "exact": round(v[2] / max(1, v[3]), 4)}
            for k, v in sorted(stats.items())}


# ----------------------------------------------------------------------------------------------
# calibration


@torch.no_grad()
def calibrate_input_scales(model: MiniMaxM3, batches: list[dict], device: torch.device, amp: str,
                           ) -> dict[tuple[str, str, int], float]:
    """NVFP4 `input_scale` per routed expert and projection: amax of the expert's inputs over the
    calibration batches / (6 * 448) (ModelOpt's static activation scale). `Experts._act` (the hook
    the engine applies to every expert input) is wrapped to record the amaxes; experts that saw no
    token get their layer's largest value."""
    amax: dict[tuple[str, str, int], torch.Tensor] = {}
    patched = []
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            def record(x: torch.Tensor, leaf: str, e: int, _name: str = name, _orig=module._act) -> torch.Tensor:
                key = (_name, leaf, e)
                a = x.detach().abs().amax().float()
                amax[key] = torch.maximum(amax[key], a) if key in amax else a
                return _orig(x, leaf, e)
            module._act = record
            patched.append((name, module))
    try:
        for batch in batches:
            with autocast(device, amp):
                lm_loss(model, batch, device)
    finally:
        for _, module in patched:
            del module._act
    scales: dict[tuple[str, str, int], float] = {}
    for name, module in patched:
        for leaf in ("w1", "w3", "w2"):
            seen = [float(amax[(name, leaf, e)]) for e in range(module.num_experts) if (name, leaf, e) in amax]
            fallback = max(seen, default=nx.NVFP4_SCALE_DIVISOR)
            for e in range(module.num_experts):
                a = float(amax[(name, leaf, e)]) if (name, leaf, e) in amax else fallback
                scales[(name, leaf, e)] = max(a, 1e-6) / nx.NVFP4_SCALE_DIVISOR
    return scales


# ----------------------------------------------------------------------------------------------
# the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write (release format)")
    p.add_argument("--run-dir", type=Path, default=None, help="logs, tokenizer, fp32 weights (default: OUT-run)")
    p.add_argument("--size", choices=sorted(SIZES), default="nano", help="model size (default: nano)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=12.0, help="time budget of the training loop (default: 12)")
    p.add_argument("--steps", type=int, default=1_000_000, help="most optimizer steps (default: no limit)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the size's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per packed sequence (default: the size's)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", type=Path, default=None,
                   help="continue from an exported checkpoint folder (its weights, decoded to fp32, and its "
                        "tokenizer) instead of a fresh initialisation")
    p.add_argument("--train", choices=["all", "vision"], default="all",
                   help="what learns: everything, or (with --init) the vision tower and projector only, the text "
                        "model frozen, its routing biases fixed and its tensors written as --init stored them (a "
                        "reading stage on an image-heavy --mix)")
    p.add_argument("--reinit-vision", action="store_true",
                   help="with --init: initialise the vision tower and projector afresh")
    p.add_argument("--vision-init", type=Path, default=None,
                   help="vision tower and projector weights from examples/nano/pretrain_vision.py "
                        "(OUT/vision.safetensors), in place of their initialisation or --init's")
    p.add_argument("--vision-lr", type=float, default=1.0,
                   help="learning rate of the vision tower and projector, as a multiple of --lr (default: 1)")
    p.add_argument("--vision-eps", type=float, default=1e-8,
                   help="AdamW eps of the vision tower and projector (default 1e-8; stage 2 of the shipped "
                        "checkpoint used 1e-15, which moves even parameters with vanishing gradients at full lr)")
    p.add_argument("--feature-l2", type=float, default=0.0,
                   help="weight of the image features' mean square in the loss (default 0; at 1e-3, with a tower "
                        "that does not read yet, it pushed the features to a constant)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the size's)")
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="final lr / peak lr (default: 0.1)")
    p.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: the size's)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dense-warmup", type=float, default=0.1,
                   help="fraction of the run with the MSA layers attending densely (default: 0.1)")
    p.add_argument("--qat-start", type=float, default=0.7,
                   help="fraction of the run after which weights are fake-quantized (default: 0.7; 1 = never)")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="routing-bias balancing step (default: 1e-3)")
    p.add_argument("--indexer-queries", type=int, default=None, help="queries per sequence for the indexer loss")
    p.add_argument("--amp", choices=["auto", "bf16", "none"], default="auto",
                   help="bf16 autocast (auto: on CUDA only)")
    p.add_argument("--attn-chunk", type=int, default=1 << 28,
                   help="largest attention temporary in elements (engine default 2^24; larger = fewer kernels)")
    p.add_argument("--moe", choices=["dense", "grouped"], default="dense",
                   help="routed experts in training: every expert on every token with zero weights where not "
                        "chosen (the engine's sync-free path; few large kernels, default) or the reference "
                        "grouping by expert (a loop over experts)")
    p.add_argument("--checkpoint-layers", action="store_true", help="recompute each layer in backward (less memory)")
    p.add_argument("--workers", type=int, default=None, help="data worker processes (default: 8 on CUDA, 0 on CPU)")
    p.add_argument("--mix", default=None, help="data mix, e.g. arith=0.35,tool=0.35,image=0.15,greet=0.03,text=0.12")
    p.add_argument("--no-stdlib", action="store_true", help="no Python standard library text (d)")
    p.add_argument("--fonts", choices=["default", "builtin"], default="default",
                   help="number-image fonts: pillow's embedded one plus DejaVu/Liberation/FreeFont found "
                        "(default), or the embedded one only (identical images on every machine)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--calib-batches", type=int, default=4, help="batches for the NVFP4 input_scale calibration")
    p.add_argument("--drafter", action="store_true",
                   help="optional stage after the export: train a DSpark drafter on the exported model's outputs "
                        "and add it as OUT/dspark (train_drafter.py)")
    p.add_argument("--drafter-minutes", type=float, default=3.0, help="time budget of the drafter stage")
    return p.parse_args(argv)


def _mix(text: str | None) -> dict[str, float] | None:
    if text is None:
        return None
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        out[k.strip()] = float(v)
    return out


def log_line(path: Path, record: dict[str, Any]) -> None:
    print(" ".join(f"{k}={v}" for k, v in record.items()), flush=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run; returns the summary written to `nano_run.json`."""
    if args.train == "vision" and args.init is None:
        raise SystemExit("--train vision continues a trained model: give --init CKPT")
    if args.reinit_vision and args.init is None:
        raise SystemExit("--reinit-vision applies to --init CKPT (a fresh run initialises everything)")
    t_start = time.time()
    size = SIZES[args.size]
    device = torch.device(args.device)
    amp = ("bf16" if device.type == "cuda" else "none") if args.amp == "auto" else args.amp
    seq_len, batch = args.seq_len or size.seq_len, args.batch or size.batch
    lr, warmup = args.lr or size.lr, size.warmup if args.warmup is None else args.warmup
    n_queries = args.indexer_queries or size.indexer_queries
    workers = args.workers if args.workers is not None else (
        min(8, max(1, (os.cpu_count() or 2) - 2)) if device.type == "cuda" else 0)
    out, run_dir = Path(args.out), Path(args.run_dir or f"{args.out}-run")
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "train_log.jsonl"
    log_path.write_text("")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # 1. data and tokenizer
    heldout = nd.make_heldout(args.seed)
    nd.write_heldout(heldout, run_dir / "heldout.json")
    nd.write_tools_json(run_dir / "tools.json")
    mix = _mix(args.mix)
    stdlib = not args.no_stdlib
    fonts = nd.find_fonts(args.fonts)
    text = nd.StdlibText(heldout) if stdlib else None
    vocab = size.text["vocab_size"]
    t0 = time.time()
    if args.init is not None:  # the model to continue comes with its tokenizer
        special = copy_tokenizer(args.init, run_dir / "tokenizer")
        print(f"tokenizer: {vocab} ids from {args.init}", flush=True)
    else:
        # the pieces kind draws from the tokenizer's vocabulary: the tokenizer is trained without it
        unpieced = {k: v for k, v in (mix or nd.DEFAULT_MIX).items() if k != "pieces"}
        special = train_tokenizer(nd.tokenizer_texts(nd.TaskGenerator(heldout, unpieced, text, fonts),
                                                     size.tokenizer_examples, args.seed), vocab,
                                  run_dir / "tokenizer")
        print(f"tokenizer: {vocab} ids trained on {size.tokenizer_examples} examples in {time.time() - t0:.1f}s",
              flush=True)
    tok = load_tokenizer(run_dir / "tokenizer")
    gen = nd.TaskGenerator(heldout, mix, text, fonts, nd.pieces_for(mix, tok))
    print(f"data: {json.dumps(nd.data_config(gen)['mix'])}, {len(fonts)} fonts", flush=True)

    # 2. model
    raw = nx.raw_config(size.text, size.vision, special, fmt="nvfp4")
    cfg = parse_model_config(raw)
    model = MiniMaxM3(cfg, numerics=Numerics(attention_chunk_elements=args.attn_chunk))
    init_weights(model, args.seed)
    if args.init is not None:
        load_init(model, args.init, reinit_vision=args.reinit_vision)
    if args.vision_init is not None:
        load_vision(model, args.vision_init)
    model.to(device)
    params = make_trainable(model)
    bias_rate = args.bias_rate
    if args.train == "vision":
        for name, p in model.named_parameters():
            if not name.startswith(("vision_tower.", "projector.")):
                p.requires_grad_(False)
        params = [p for p in params if p.requires_grad]
        bias_rate = 0.0  # the frozen text model keeps its routing
    # The indexer learns from its own KL loss only; its gradients are clipped apart from the model's, so
    # that the (large, early) indexer gradient does not shrink the language-model update.
    indexer_ids = {id(p) for n, p in model.named_parameters() if ".index_" in n}
    lm_params = [p for p in params if id(p) not in indexer_ids]
    indexer_params = [p for p in params if id(p) in indexer_ids]
    if args.moe == "dense":  # 4x the expert FLOPs of top-4 of 16, but a nano model is bound by kernel launches
        apply(model, FastPaths(moe=True, sync_free_tokens=1 << 40))
    if args.checkpoint_layers:
        from torch.utils.checkpoint import checkpoint

        for layer in model.layers:
            layer.forward = (lambda *a, _f=layer.forward: checkpoint(_f, *a, use_reentrant=False))
    counts = count_parameters(cfg)
    print(f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['active_text'] / 1e6:.2f}M active text), "
          + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in counts.items() if k not in ("total", "active_text")),
          flush=True)
    assert sum(p.numel() for p in model.parameters()) == counts["total"], "count_parameters is out of date"

    vision_ids = {id(p) for n, p in model.named_parameters() if n.startswith(("vision_tower.", "projector."))}
    decay = [p for p in params if p.ndim >= 2 and id(p) not in vision_ids]
    no_decay = [p for p in params if p.ndim < 2 and id(p) not in vision_ids]
    vision = [p for p in params if id(p) in vision_ids]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0},
                             {"params": vision, "weight_decay": 0.0, "eps": args.vision_eps,
                              "lr_scale": args.vision_lr}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    loader = torch.utils.data.DataLoader(
        BatchStream(run_dir / "tokenizer", heldout, mix, stdlib, fonts, args.seed, seq_len, batch),
        batch_size=None, num_workers=workers, pin_memory=device.type == "cuda",
        prefetch_factor=4 if workers else None, persistent_workers=workers > 0)
    batches = iter(loader)
    evals = eval_batches(gen, tok, size.eval_per_kind, args.seed)
    capture = IndexerCapture(model)
    g_index = torch.Generator().manual_seed(args.seed)

    # 3. training
    budget = args.minutes * 60.0
    step, tokens, targets = 0, 0, 0
    qat = False
    dense = args.dense_warmup > 0
    set_dense(model, dense)
    acc_loss = acc_aux = acc_imb = acc_feat = 0.0
    acc_n = 0
    t_train = time.time()
    last_eval: dict[str, Any] = {}
    model.train()
    while True:
        elapsed = time.time() - t_train
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            break
        if dense and progress >= args.dense_warmup:
            set_dense(model, False)
            dense = False
            print(f"step {step}: MSA layers now sparse (top-{cfg.text.sparse.topk_blocks} blocks of "
                  f"{cfg.text.sparse.block_size})", flush=True)
        if not qat and progress >= args.qat_start:
            n = enable_qat(model)
            qat = True
            print(f"step {step}: quantization-aware training on ({n} weights fake-quantized)", flush=True)
        cur_lr = lr * min(1.0, (step + 1) / max(1, warmup))
        cur_lr *= args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        for group in opt.param_groups:
            group["lr"] = cur_lr * group.get("lr_scale", 1.0)
        trace = Trace(layers=set())
        for _ in range(args.grad_accum):
            # one cached fake-quantization per micro-batch: each backward consumes its own graph
            with parametrize.cached() if qat else contextlib.nullcontext():
                b = next(batches)
                stats: dict[str, torch.Tensor] = {}
                with autocast(device, amp):
                    loss, _, labels = lm_loss(model, b, device, trace, stats)
                    aux = sum(indexer_kl(model.layers[i].self_attn, *capture.inputs[i], n_queries, g_index)
                              for i in capture.inputs) / max(1, len(capture.inputs))
                feature_ms = stats.get("feature_ms", torch.zeros((), device=device))
                total = (loss + aux + args.feature_l2 * feature_ms) / args.grad_accum
                if total.requires_grad:  # with --train vision, a batch without images reaches no parameter
                    total.backward()
                acc_feat += feature_ms.detach()
                tokens += labels.numel()
                targets += int((labels != -100).sum())
                acc_loss += loss.detach()  # summed on the device; read (one sync) when logged
                acc_aux += aux.detach()
                acc_n += 1
        gnorm = torch.nn.utils.clip_grad_norm_(lm_params, args.grad_clip)
        if indexer_params:
            torch.nn.utils.clip_grad_norm_(indexer_params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc_imb += update_routing_bias(model, trace, bias_rate)
        capture.inputs.clear()
        step += 1
        if step % args.log_every == 0 or step == 1:
            now = time.time()
            log_line(log_path, {"step": step, "loss": round(float(acc_loss) / acc_n, 4),
                                "indexer_kl": round(float(acc_aux) / acc_n, 4), "lr": f"{cur_lr:.2e}",
                                "feature_rms": round(math.sqrt(float(acc_feat) / acc_n), 3),
                                "gnorm": round(float(gnorm), 3),
                                "load_max/mean": round(acc_imb / max(1, acc_n // args.grad_accum), 2),
                                "tok/s": int(tokens / (now - t_train)), "elapsed_s": int(now - t_train),
                                "dense": dense, "qat": qat})
            acc_loss = acc_aux = acc_imb = acc_feat = 0.0
            acc_n = 0
        if step % args.eval_every == 0:
            model.eval()
            with parametrize.cached() if qat else contextlib.nullcontext():
                last_eval = teacher_forced_eval(model, evals, device, amp)
            model.train()
            log_line(log_path, {"step": step, "eval": json.dumps(last_eval)})
    train_seconds = time.time() - t_train
    capture.remove()
    set_dense(model, False)
    model.eval()
    with parametrize.cached() if qat else contextlib.nullcontext():
        final_eval = teacher_forced_eval(model, evals, device, amp)
    log_line(log_path, {"step": step, "final_eval": json.dumps(final_eval)})

    # 4. calibration and export
    calib = [next(batches) for _ in range(args.calib_batches)]
    apply(model, False)  # calibration records each expert's own inputs: the grouped reference path
    with parametrize.cached() if qat else contextlib.nullcontext():
        scales = calibrate_input_scales(model, calib, device, amp)
    disable_qat(model)
    from safetensors.torch import save_file

    save_file({k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()},
              str(run_dir / "model_fp32.safetensors"))
    summary: dict[str, Any] = {
        "size": args.size, "seed": args.seed, "steps": step, "train_seconds": round(train_seconds, 1),
        "tokens": tokens, "target_tokens": targets, "seq_len": seq_len, "batch": batch * args.grad_accum,
        "peak_lr": lr, "qat": qat, "parameters": counts, "device": str(device),
        "torch": torch.__version__, "data": nd.data_config(gen), "teacher_forced_eval": final_eval,
        "heldout": heldout.to_json(),
    }
    pre = dataclasses.asdict(nd.PREPROCESSOR)
    preprocessor = {"min_pixels": pre["min_pixels"], "max_pixels": pre["max_pixels"], "patch_size": pre["patch_size"],
                    "temporal_patch_size": pre["temporal_patch_size"], "merge_size": pre["merge_size"],
                    "image_mean": list(pre["image_mean"]), "image_std": list(pre["image_std"]),
                    "image_processor_type": "MiniMaxM3VLImageProcessor"}
    if (out / "dspark").is_dir():  # a drafter of an earlier run belongs to that run's model
        import shutil

        shutil.rmtree(out / "dspark")
    # a frozen text model keeps the bytes it was stored in (encoding its decoded weights again is not idempotent)
    keep = nx.stored_tensors(args.init, "language_model.") if args.train == "vision" else None
    nx.write_checkpoint(model, raw, out, run_dir / "tokenizer", fmt="nvfp4", input_scales=scales,
                        preprocessor=preprocessor, extra_files={"nano_run.json": summary}, keep=keep)

    # 5. verify: load the checkpoint with the engine and evaluate it next to the trained model
    import minimax_ref as mr

    loaded = mr.load_model(out, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    quant_eval = teacher_forced_eval(loaded, evals, device, "none")
    summary["checkpoint_bytes"] = nx.folder_bytes(out)
    summary["teacher_forced_eval_quantized"] = quant_eval
    samples = mr.generate(loaded, mr.load_tokenizer(out), ["What is 17*23?", "Weather in Lisbon for 3 days?"],
                          chat=True, tools=nd.TOOLS, max_new_tokens=160, temperature=0)
    summary["samples"] = [{"text": r.text, "tool_calls": r.tool_calls} for r in samples]
    summary["total_seconds"] = round(time.time() - t_start, 1)
    (out / "nano_run.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    log_line(log_path, {"checkpoint": str(out), "bytes": summary["checkpoint_bytes"],
                        "quantized_eval": json.dumps(quant_eval)})
    for r in samples:
        print("sample:", repr(r.text[:300]), r.tool_calls, flush=True)
    if args.drafter:  # optional stage 6: the DSpark drafter (reads and updates OUT/nano_run.json)
        from examples.nano import train_drafter

        drafter_args = ["--ckpt-path", str(out), "--device", args.device, "--minutes", str(args.drafter_minutes),
                        "--seed", str(args.seed), "--workers", str(workers)]
        summary["drafter"] = train_drafter.train_drafter(train_drafter.parse_args(drafter_args))
    return summary


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
