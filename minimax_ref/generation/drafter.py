"""The DSpark drafter of MiniMax-M3.1-Flash (`<ckpt>/dspark/`, spec `dspark.md`).

DSpark drafts a block of B tokens in two stages: one parallel pass of a small dense transformer over
`[anchor, noise x (B-1)]` gives base logits U[0..B-1], then a cheap left-to-right "Markov" pass adds a
low-rank bias from the previously drafted token. The drafter has no embedding and no LM head of its
own: it uses the target's. Everything below is per `dspark.md`; where that page leaves a choice, the
choice is marked "decided here" and listed again in `weights.md`.

Context. For every position the target processes (prefill and each verify pass), the residual stream
after the target layers `dspark_target_layer_ids` is captured (`model.Trace` in the prefill,
`MiniMaxM3.step_with_hidden` in verify steps; no second forward) and concatenated: `aux [N, len(ids) * H]`.
Context rows `c = hidden_norm(fc(aux))` go, per draft layer, into a draft KV cache as
`K = RoPE(k_norm(k_proj(c)))`, `V = v_proj(c)` at their positions (no input_layernorm on context rows).
Which capture of the target's *last* layer feeds the drafter is an open point (before or after the target's
final norm): `capture_final_norm` (default False, the residual stream before the final norm, as the public
MiniMax port does).

Block. The anchor `a` (the last emitted token, not yet run through the target) sits at position t;
the block `[a, noise x (B-1)]` at positions t..t+B-1 is embedded with the target's embedding and run
through the draft layers (Gemma norms, per-head q/k norm, partial NeoX RoPE, GQA, SwiGLU-OAI MLP).
Attention: every block query sees all B block keys (non-causal inside the block) and the context keys
at positions p < t with p >= q - (W - 1), W = `sliding_window` (the last W positions up to and
including the query's own; decided here per query position, as the public SGLang port's
`window_size=(W-1, W-1)`). Base logits `U = lm_head(final_norm(x))`, gathered over the target's
tensor-parallel ranks like the target's own logits.

Markov pass. `prev = a`; for k in 0..N-1: `z_k = U[k] + markov_w2 @ markov_w1[prev]`; the draft
`d_k` is argmax(z_k) (greedy) or a sample of `q_k = filtered_probs(z_k, sampling)` (`sampling.py`; the same
temperature/top-k/top-p as the target; in a batch of requests each row with its own setting and generator,
`sampling.RowSampling`); `prev = d_k`. Block position k predicts position t+k+1.

Confidence head. `c_k = sigmoid(proj([h_k ; markov_w1[prev_k]]))` with h_k the block's final-normed
hidden state at position k (the LM head's input, as DeepSpec's reference feeds it) and prev_k the
token before it (the anchor for k=0). It is computed and returned; using it to cut the verified
prefix is optional (speculative.py, off by default) and never changes which tokens are output.

Numerics follow the target (weights.md): projections in the compute dtype, norms / RoPE / attention
core in fp32, logits fp32. The Markov bias `markov_w2 @ markov_w1[prev]` is computed in the compute
dtype and added to the fp32 base logits (decided here: it is what the LM head does too).

Tensor parallelism: the drafter is replicated on every rank (its weights are small) and uses the
target only through `embed`, `lm_head`, `norm` and the residual stream captured by the forward, which
are replicated; every rank computes the same drafts from the same seed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, ConfigError, InputError
from ..model.config import DrafterConfig, TextConfig, parse_drafter_config, read_json
from ..model.linear import ACT_QUANT_MODES, Linear
from ..model.mlp import MLP
from ..model.norm import RMSNorm
from ..model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ..weights.checkpoint import (
    DENSE,
    FLOAT_DTYPES,
    MXFP8,
    Checkpoint,
    LinearSpec,
    QuantScheme,
    TensorSpec,
    _check_linear,
    _check_plain,
    _linear_format,
    placed,
    scan_shards,
)
from .sampling import RowSampling, SamplingParams

if TYPE_CHECKING:
    from ..model.decoder import MiniMaxM3

PREFIX = "language_model.model.dspark."
ARCHITECTURE = "DSparkMiniMaxDraftModel"
SUBFOLDER = "dspark"
# Names that would mean the drafter carries its own embedding or LM head (DSpark shares the target's).
_SHARED_WEIGHTS = re.compile(r"(^|\.)(embed_tokens|lm_head)(\.|$)")


# ----------------------------------------------------------------------------------------------
# tensor names


def _module_path(name: str) -> str:
    """Engine parameter path of a release tensor name: the prefix and `decoder_layer.` dropped."""
    return name[len(PREFIX):].replace(".decoder_layer.", ".")


def drafter_tensor_table(cfg: DrafterConfig) -> tuple[dict[str, LinearSpec], dict[str, TensorSpec]]:
    """The release's tensor names for a drafter: linears by prefix, plain tensors by full name.

    Linears (`fc` and the layers' attention / MLP projections) may be bf16 or MXFP8 (the release:
    `fc` bf16, the layers MXFP8); the rest is never quantized.
    """
    H, D, V, r = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.markov_rank
    linears: dict[str, LinearSpec] = {}
    plain: dict[str, TensorSpec] = {}

    def lin(name: str, out: int, inp: int) -> None:
        prefix = PREFIX + name
        linears[prefix] = LinearSpec(prefix, out, inp, "drafter", _module_path(prefix))

    def ten(name: str, shape: tuple[int, ...], family: str = "drafter") -> None:
        full = PREFIX + name
        plain[full] = TensorSpec(full, shape, family, _module_path(full), FLOAT_DTYPES)

    lin("fc", H, len(cfg.target_layer_ids) * H)
    ten("hidden_norm.weight", (H,), "norm")
    ten("final_norm.weight", (H,), "norm")
    ten("markov_head.markov_w1.weight", (V, r))
    ten("markov_head.markov_w2.weight", (V, r))
    if cfg.enable_confidence_head:
        width = H + (r if cfg.confidence_head_with_markov else 0)
        ten("confidence_head.proj.weight", (1, width))
        ten("confidence_head.proj.bias", (1,))
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}.decoder_layer."
        ten(p + "input_layernorm.weight", (H,), "norm")
        ten(p + "post_attention_layernorm.weight", (H,), "norm")
        ten(p + "self_attn.q_norm.weight", (D,), "norm")
        ten(p + "self_attn.k_norm.weight", (D,), "norm")
        lin(p + "self_attn.q_proj", cfg.num_attention_heads * D, H)
        lin(p + "self_attn.k_proj", cfg.num_key_value_heads * D, H)
        lin(p + "self_attn.v_proj", cfg.num_key_value_heads * D, H)
        lin(p + "self_attn.o_proj", H, cfg.num_attention_heads * D)
        lin(p + "mlp.gate_proj", cfg.intermediate_size, H)
        lin(p + "mlp.up_proj", cfg.intermediate_size, H)
        lin(p + "mlp.down_proj", H, cfg.intermediate_size)
    return linears, plain


# ----------------------------------------------------------------------------------------------
# draft KV cache


class DraftCache:
    """Context K/V of every draft layer by absolute position: `k[layer]`, `v[layer]` are
    [B, max_len, kv_heads, D] in the compute dtype; slot p holds the context row of position p.

    Only context rows live here; the block's own K/V are recomputed each draft and never cached.
    Which slots are valid is decided by the caller (the anchor position t: slots < t), so stale
    slots are harmless; `rollback` zeroes them anyway so the cache equals one that never saw them.
    """

    def __init__(self, n_layers: int, batch_size: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch_size, max_len, kv_heads, head_dim)
        self.batch_size, self.max_len = batch_size, max_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [B, T, kv_heads, D] of the context rows at `positions` [B, T]."""
        rows = torch.arange(k.shape[0], device=positions.device)[:, None]
        self.k[layer][rows, positions] = k.to(self.k[layer].dtype)
        self.v[layer][rows, positions] = v.to(self.v[layer].dtype)

    def rollback(self, lengths: torch.Tensor | Iterable[int]) -> None:
        """Forget every slot at or past `lengths[b]` for each sequence b (zeroes them)."""
        for b, n in enumerate(torch.as_tensor(lengths).tolist()):
            for buf in (*self.k, *self.v):
                buf[b, n:] = 0

    def rows(self, start: int, stop: int) -> DraftCache:
        """Sequences start..stop-1 as a cache of their own: views of this cache's buffers, so what is written
        through it lands here (a request prefilled into its slot of a running batch)."""
        view = object.__new__(DraftCache)
        view.batch_size, view.max_len = stop - start, self.max_len
        view.k = [k[start:stop] for k in self.k]
        view.v = [v[start:stop] for v in self.v]
        return view


@dataclass
class Draft:
    """One drafting pass for a batch.

    tokens: [B, N] drafted ids; tokens[:, k] is proposed for position t + k + 1.
    probs: [B, N, V] fp32 draft distributions q_k the tokens were sampled from (after temperature /
        top-k / top-p), or None for greedy drafts (point masses on `tokens`).
    confidence: [B, N] fp32 confidence-head scores in (0, 1), or None when the drafter has no head.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------
# modules


def block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, ctx_pos: torch.Tensor, q_pos: torch.Tensor, ctx_len: torch.Tensor,
                    window: int, scale: float) -> torch.Tensor:
    """DSpark block attention, fp32. Returns [B, T, Hq, D].

    q, k_blk, v_blk: the block's queries [B, T, Hq, D] and keys/values [B, T, Hkv, D]; every query sees
    every block key (non-causal). k_ctx, v_ctx [B, L, Hkv, D]: context rows at absolute positions
    `ctx_pos` [L] (the same for every row) or [B, L]; query i of row b (at position q_pos[b, i]) sees
    context key l iff `ctx_pos[b, l] < ctx_len[b]` (a committed position) and
    `ctx_pos[b, l] >= q_pos[b, i] - (window - 1)`. Query head h reads kv head h // (Hq / Hkv).
    """
    B, T, Hq, D = q.shape
    Hkv = k_blk.shape[2]
    G = Hq // Hkv
    keys = torch.cat((k_ctx, k_blk), dim=1).float().permute(0, 2, 1, 3)  # [B, Hkv, L+T, D]
    vals = torch.cat((v_ctx, v_blk), dim=1).float().permute(0, 2, 1, 3)
    qg = q.float().view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    scores = torch.einsum("bhgtd,bhld->bhgtl", qg, keys) * scale
    ctx = ctx_pos.expand(B, -1)[:, None, :]  # [B, 1, L]
    visible_ctx = (ctx < ctx_len[:, None, None]) & (ctx >= q_pos[:, :, None] - (window - 1))  # [B, T, L]
    visible = torch.cat((visible_ctx, visible_ctx.new_ones(B, T, T)), dim=-1)
    p = torch.softmax(scores.masked_fill(~visible[:, None, None], float("-inf")), dim=-1)
    out = torch.einsum("bhgtl,bhld->bhgtd", p, vals)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


class DraftAttention(nn.Module):
    """`self_attn` of a draft layer: q/k/v/o projections, per-head Gemma q/k norms (names as released)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.scale = D**-0.5
        self.window = cfg.sliding_window
        self.q_proj = Linear(H, self.n_heads * D)
        self.k_proj = Linear(H, self.n_kv * D)
        self.v_proj = Linear(H, self.n_kv * D)
        self.o_proj = Linear(self.n_heads * D, H)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of context rows c [B, T, H]: RoPE(k_norm(k_proj(c))), v_proj(c)."""
        B, T, _ = c.shape
        k = apply_rope(self.k_norm(self.k_proj(c).view(B, T, self.n_kv, self.head_dim)), cos, sin)
        return k, self.v_proj(c).view(B, T, self.n_kv, self.head_dim)

    def forward(self, x: torch.Tensor, q_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_pos: torch.Tensor,
                ctx_len: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)), cos, sin)
        k, v = self.context_kv(x, cos, sin)
        o = block_attention(q, k, v, k_ctx, v_ctx, ctx_pos, q_pos, ctx_len, self.window, self.scale)
        return self.o_proj(o.to(x.dtype).reshape(B, T, -1))


class DraftDecoderLayer(nn.Module):
    """A dense pre-norm layer: `x + attn(input_layernorm(x))`, then `+ mlp(post_attention_layernorm(.))`."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, q_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_pos: torch.Tensor,
                ctx_len: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), q_pos, cos, sin, k_ctx, v_ctx, ctx_pos, ctx_len)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Table(nn.Module):
    """A lookup table with the release's parameter name `weight` [rows, dim] (markov_w1)."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _Affine(nn.Module):
    """`x @ weight^T + bias` (the confidence head's `proj`, the drafter's only biased linear)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MarkovHead(nn.Module):
    """Vanilla Markov head: bias(prev) = markov_w2 @ markov_w1[prev], rank r (w1 [V, r], w2 [V, r])."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = _Table(vocab, rank)
        self.markov_w2 = Linear(rank, vocab)

    def bias(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logit bias [B, V], the embedding markov_w1[prev] [B, r]) for previous tokens [B]."""
        e = self.markov_w1(prev)
        return self.markov_w2(e).float(), e


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = _Affine(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(features).float()).squeeze(-1)


def _target_logits(target: MiniMaxM3, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the target's LM head on h (no final norm: h is already normed). Under tensor
    parallelism the LM head holds a vocabulary slice; the slices are gathered as the target does."""
    logits = target.lm_head(h).float()
    world = getattr(target, "world", None)
    return logits if world is None else world.all_gather(logits, dim=-1)


class DSparkDrafter(nn.Module):
    """The DSpark drafter (spec `dspark.md`). Module and parameter names are the release's with the
    `language_model.model.dspark.` prefix and `decoder_layer.` dropped.

    capture_final_norm: feed the target's last layer to the drafter after the target's final norm
        (True) or before it (False, default: the residual stream). Only matters when the last target
        layer is one of `target_layer_ids`.
    """

    def __init__(self, cfg: DrafterConfig, target_num_layers: int, capture_final_norm: bool = False):
        super().__init__()
        self.config = cfg
        self.target_num_layers = target_num_layers
        self.capture_final_norm = capture_final_norm
        H = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * H, H)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))

    # ---- what the speculative loop uses

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def capture_layer_ids(self) -> set[int]:
        """Target layers whose residual stream the drafter reads (`Trace(layers=...)`, `step_with_hidden`)."""
        return set(self.config.target_layer_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self, batch_size: int, max_len: int) -> DraftCache:
        c = self.config
        return DraftCache(c.num_hidden_layers, batch_size, max_len, c.num_key_value_heads, c.head_dim,
                          self.dtype, self.device)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.config.rotary_dim, self.config.rope_theta, positions.device)
        return rope_cos_sin(positions, inv_freq)

    def context_features(self, target: MiniMaxM3, hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """aux [B, T, len(ids) * H]: the target's residual streams after `target_layer_ids` (`hidden`: {layer:
        [B, T, H]}, e.g. `Trace.hidden_states` or `MiniMaxM3.step_with_hidden`'s), in that order."""
        parts = []
        for layer in self.config.target_layer_ids:
            h = hidden[layer]
            if self.capture_final_norm and layer == self.target_num_layers - 1:
                h = target.norm(h)
            parts.append(h.to(self.dtype))
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def add_context(self, target: MiniMaxM3, cache: DraftCache, hidden: Mapping[int, torch.Tensor],
                    positions: torch.Tensor) -> None:
        """Write the context rows of every position a target forward processed at `positions` [B, T] into every
        layer's cache; `hidden`: that forward's residual streams after `capture_layer_ids` ({layer: [B, T, H]}:
        `Trace(layers=self.capture_layer_ids).hidden_states`, or what `MiniMaxM3.step_with_hidden` returns)."""
        c = self.hidden_norm(self.fc(self.context_features(target, hidden)))
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(c, cos, sin)
            cache.write(i, k, v, positions)

    @torch.no_grad()
    def block_hidden(self, target: MiniMaxM3, cache: DraftCache, anchors: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B, block, H] of the block `[anchor, noise x (block-1)]` at
        positions t..t+block-1 (t = `positions` [B], also the number of valid context rows)."""
        B, Bk, W = anchors.shape[0], self.block_size, self.config.sliding_window
        ids = torch.full((B, Bk), self.config.noise_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        q_pos = positions[:, None] + torch.arange(Bk, device=positions.device)
        cos, sin = self._rope(q_pos)
        # context slots any block query can see: [min(t) - (W-1), max(t)); the mask does the rest
        lo, hi = max(0, int(positions.min()) - (W - 1)), int(positions.max())
        ctx_pos = torch.arange(lo, hi, device=positions.device)
        x = target.embed(ids).to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, q_pos, cos, sin, cache.k[i][:, lo:hi], cache.v[i][:, lo:hi], ctx_pos, positions)
        return self.final_norm(x)

    def block_logits(self, target: MiniMaxM3, cache: DraftCache, anchors: torch.Tensor,
                     positions: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(base logits U [B, N, V] fp32, hidden states h [B, N, H]) of the first N block positions.

        A separate method so that tests (and research) can substitute the base logits."""
        h = self.block_hidden(target, cache, anchors, positions)[:, :num_tokens]
        return _target_logits(target, h), h

    @torch.no_grad()
    def markov_pass(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                    sampling: SamplingParams | RowSampling, generator: torch.Generator | None) -> Draft:
        """The sequential stage: z_k = U[k] + markov_w2 @ markov_w1[prev]; greedy argmax or a sample
        of q_k = filtered_probs(z_k, sampling); prev = d_k (the anchor for k = 0). `sampling`: one setting for
        every row, drawing from `generator`, or a `RowSampling` (each row its own setting and generator)."""
        B, N = base_logits.shape[:2]
        rows = sampling if isinstance(sampling, RowSampling) else RowSampling.same(sampling, B, generator)
        tokens = torch.empty(B, N, dtype=torch.long, device=base_logits.device)
        probs = None if rows.greedy else torch.empty_like(base_logits)
        conf = None if self.confidence_head is None else torch.empty(B, N, device=base_logits.device)
        prev = anchors
        for k in range(N):
            bias, e = self.markov_head.bias(prev)
            z = base_logits[:, k] + bias
            if conf is not None:
                feats = hidden[:, k] if not self.config.confidence_head_with_markov else torch.cat(
                    (hidden[:, k], e.to(hidden.dtype)), dim=-1)
                conf[:, k] = self.confidence_head(feats)
            d, q = rows.sample(z)
            if probs is not None:
                probs[:, k] = q
            tokens[:, k] = d
            prev = d
        return Draft(tokens, probs, conf)

    @torch.no_grad()
    def draft(self, target: MiniMaxM3, cache: DraftCache, anchors: torch.Tensor, positions: torch.Tensor,
              num_tokens: int, sampling: SamplingParams | RowSampling, generator: torch.Generator | None) -> Draft:
        """Draft `num_tokens` (<= block size) tokens after each anchor [B] at positions t [B]; the
        context cache must hold the rows of positions < t. Sampling as `markov_pass`."""
        if not 1 <= num_tokens <= self.block_size:
            raise InputError(f"num_tokens={num_tokens}: the drafter proposes 1..{self.block_size} tokens")
        U, h = self.block_logits(target, cache, anchors, positions, num_tokens)
        return self.markov_pass(U, h, anchors, sampling, generator)


# ----------------------------------------------------------------------------------------------
# loading


def _check_raw_config(raw: dict, where: str) -> None:
    """What `dspark/config.json` must say beyond `parse_drafter_config` (one ConfigError per field)."""
    tc = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw

    def get(key: str):
        return tc.get(key, raw.get(key))

    arch = raw.get("architectures") or tc.get("architectures")
    if arch is not None and ARCHITECTURE not in arch:
        raise ConfigError(f"{where}: architectures={arch!r}: expected [{ARCHITECTURE!r}]")
    if get("use_gemma_norm") is False:
        raise ConfigError(f"{where}: use_gemma_norm=false: only Gemma (1 + w) RMSNorm is implemented")
    moe = get("moe_layer_freq")
    if moe is not None and any(moe):
        raise ConfigError(f"{where}: moe_layer_freq={moe!r}: DSpark draft layers are dense (all 0)")
    types = get("layer_types")
    if types is not None and any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"{where}: layer_types={types!r}: only sliding_attention/full_attention layers exist")




def open_drafter(path: str | Path, target: TextConfig) -> tuple[DrafterConfig, Checkpoint]:
    """Open and validate a `dspark/` folder against the target's text config (headers only).

    Every problem (missing, misshapen or unexpected tensors, wrong dtypes, formats disagreeing with
    `quantization_config`, unreadable shards, and an embedding or LM head the drafter must not carry)
    is raised together as one CheckpointError. Config values the engine cannot run: ConfigError.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no DSpark drafter folder here (write one with `minimax-ref synth --drafter`)")
    raw = read_json(path / "config.json", "DSpark drafter config.json")
    where = str(path / "config.json")
    _check_raw_config(raw, where)
    cfg = parse_drafter_config(raw, target, where)
    if not 0 <= cfg.noise_token_id < cfg.vocab_size:
        raise ConfigError(f"{where}: dspark_noise_token_id={cfg.noise_token_id} is outside the vocabulary "
                          f"[0, {cfg.vocab_size})")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_key_value_heads={cfg.num_key_value_heads} must divide "
                          f"num_attention_heads={cfg.num_attention_heads}")
    if not 0 < cfg.rotary_dim <= cfg.head_dim or cfg.rotary_dim % 2:
        raise ConfigError(f"{where}: rotary_dim={cfg.rotary_dim} must be even and in (0, head_dim={cfg.head_dim}] "
                          "(RoPE rotates channel pairs)")
    if cfg.block_size < 1 or cfg.sliding_window < 1:
        raise ConfigError(f"{where}: dspark_block_size={cfg.block_size} and sliding_window={cfg.sliding_window} "
                          "must be >= 1")
    tensors, problems = scan_shards(path)

    shared = sorted(n for n in tensors if _SHARED_WEIGHTS.search(n))
    for name in shared:
        problems.append(f"{name} in {tensors[name].shard}: the drafter carries its own "
                        f"{'LM head' if 'lm_head' in name else 'embedding'}; DSpark shares the target's "
                        "embed_tokens and lm_head, so a drafter must not ship them")

    linears, plain = drafter_tensor_table(cfg)
    scheme = QuantScheme(cfg.quantization, f"{where} quantization_config")
    known: set[str] = set(shared)
    formats = {}
    for prefix, spec in linears.items():
        f = _linear_format(prefix, tensors)
        if f is None:
            problems.append(f"missing tensor {prefix}.weight ([{spec.out_features}, {spec.in_features}])")
            continue
        if f.fmt == MXFP8 and f.scale not in tensors:
            f.scale = prefix + ".weight_scale_inv"  # report the release's name for a missing scale
        formats[prefix] = f
        known.update(n for n in (f.weight, f.scale, f.scale_2, f.input_scale) if n)
        _check_linear(spec, f, tensors, problems)
        if f.fmt not in (DENSE, MXFP8):
            problems.append(f"{prefix} is stored {f.fmt}; drafter linears are bf16 or MXFP8")
        elif f.fmt == MXFP8 and scheme.expected(prefix) not in ("any", "MXFP8"):
            problems.append(f"{prefix} is stored MXFP8 but quantization_config does not quantize it")
    for name, spec in plain.items():
        known.add(name)
        _check_plain(spec, tensors, problems)
    for name in sorted(set(tensors) - known):
        problems.append(f"unexpected tensor {name} in {tensors[name].shard} (not part of this drafter's config)")
    if problems:
        head = "carries its own embedding / LM head (DSpark uses the target's) and " if shared else ""
        raise CheckpointError(f"{path}: the DSpark drafter {head}does not match its config.json "
                              f"({len(problems)} problems)", problems)
    return cfg, Checkpoint(path, None, tensors, linears, plain, formats, problems)  # type: ignore[arg-type]


@torch.no_grad()
def load_drafter(path: str | Path, target: MiniMaxM3, *, capture_final_norm: bool = False,
                 act_quant: str | None = None) -> DSparkDrafter:
    """Load a `dspark/` folder as a `DSparkDrafter` for `target`, on the target's device and in its
    compute dtype (norms fp32), in eval mode.

    MXFP8 linears are decoded exactly to fp32 (`quant.dequant_mxfp8`) and cast once. act_quant:
    "none" or "emulate" (fake-quantize the MXFP8 linears' inputs); default: the target's setting.
    capture_final_norm: see `DSparkDrafter`. A target with fast paths gives them to the drafter
    (`fast.drafter.FastDSparkDrafter`). Raises CheckpointError (every problem together) or ConfigError.
    """
    from ..model.linear import set_activation_formats

    act_quant = act_quant or getattr(target, "act_quant", "none")
    if act_quant not in ACT_QUANT_MODES:
        raise ConfigError(f"act_quant={act_quant!r}: choose one of {list(ACT_QUANT_MODES)}")
    cfg, ck = open_drafter(path, target.text)
    device, dtype = target.device, target.dtype
    with torch.device("meta"):
        drafter = DSparkDrafter(cfg, target.text.num_hidden_layers, capture_final_norm)
        set_activation_formats(drafter, {spec.module: ck.formats[prefix].fmt for prefix, spec in ck.linears.items()},
                               act_quant == "emulate")
    state: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for spec in ck.plain.values():
        state[spec.module] = placed(ck.read(spec.name), device, torch.float32 if spec.family == "norm" else dtype)
    for prefix, spec in ck.linears.items():
        try:
            state[spec.module + ".weight"] = placed(ck.read_linear(prefix), device, dtype)
        except CheckpointError as e:
            problems.append(str(e))
    ck.close()
    if problems:
        raise CheckpointError(f"{path}: {len(problems)} drafter tensors cannot be decoded", problems)
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.source_path = Path(path)
    target.share_paths(drafter)
    return drafter.eval()


def resolve_drafter(model: MiniMaxM3, draft: DSparkDrafter | str | Path, *,
                    capture_final_norm: bool = False) -> DSparkDrafter:
    """`generate`'s `draft` argument as a drafter: a loaded one as is, "dspark" for the target
    checkpoint's own `dspark/` folder, or a path to a drafter folder."""
    if isinstance(draft, DSparkDrafter):
        return draft
    if isinstance(draft, str) and draft == SUBFOLDER:
        ckpt = getattr(model, "ckpt_path", None)
        if ckpt is None:
            raise ConfigError("draft='dspark' needs a model loaded from a checkpoint folder (model.ckpt_path)")
        return load_drafter(Path(ckpt) / SUBFOLDER, model, capture_final_norm=capture_final_norm)
    if isinstance(draft, (str, Path)):
        return load_drafter(draft, model, capture_final_norm=capture_final_norm)
    raise ConfigError(f"draft={draft!r}: pass a DSparkDrafter (drafter.load_drafter), 'dspark' or a folder")


__all__ = ["DSparkDrafter", "DraftCache", "Draft", "load_drafter", "open_drafter", "resolve_drafter",
           "drafter_tensor_table", "block_attention", "PREFIX", "ARCHITECTURE"]
