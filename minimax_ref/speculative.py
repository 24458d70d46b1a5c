"""Speculative decoding: a drafter proposes tokens, the target verifies them in one forward.

The loop (spec `dspark.md`, "Verification"), for a batch of right-padded prompts of different lengths:

1. Prefill the target with a `Trace` capturing the drafter's target layers; every prompt position
   becomes a context row of the drafter (`drafter.add_context`). The first token is sampled from the
   last prompt position's logits exactly as `generate.generate_ids` does; it is the first anchor.
2. Each step, per row: the anchor `a` sits at position t = the row's committed length (the number of
   positions the target has processed and kept). The drafter proposes d_0..d_{k-1} (d_i for position
   t+i+1); the target runs `[a, d_0..d_{k-1}]` at positions t..t+k in ONE forward (each row at its
   own positions) and returns the logits of all k+1 positions, capturing the drafter's layers again.
3. Acceptance per row (`accept_greedy` / `accept_drafts`): j drafts are accepted and one more token is
   emitted (the correction at the first rejection, or the bonus token when all k are accepted), so a
   step emits j+1 tokens. Greedy output is token-identical to plain greedy decoding; sampled output
   has exactly the target's distribution.
4. Rollback: positions t..t+j are kept (the anchor and the accepted drafts), so the target's KV and
   index-key caches and the drafter's context cache are rolled back to length t+j+1; the verify pass's
   captures of those j+1 positions are the new context rows (the last of them is the row whose logits
   produced the emitted token). The emitted token is the next anchor, at position t+j+1.

Stop tokens, `max_new_tokens` and the maximum length are applied as `generate_ids` does: tokens past
a stop token or the limits are dropped and the caches keep only what precedes the row's last emitted
token, so after a run the caches equal those of a plain run over `prompt + generated[:-1]`.

k per step is `num_speculative_tokens` (default: the drafter's block size), lowered near the end so
no row drafts more tokens than it may still emit; the same k serves the whole batch (finished rows
ride along, as in `generate_ids`, and are rolled back to their frozen length). An optional
confidence threshold verifies, per row, only the drafts before the first one whose confidence score
is below it; this changes how many tokens a step may emit, never which (off by default).

Sampling randomness comes from one `torch.Generator` seeded with `seed`: the first token (as
`generate.sample`), the drafter's samples, then per step a [B, k+1] block of uniforms for the
acceptance rule. Every tensor-parallel rank therefore makes the same decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .drafter import Draft
from .errors import InputError
from .generate import (
    PREFILL_CHUNK,
    GenerationStats,
    SamplingParams,
    Sequence_,
    _check_prompts,
    filtered_probs,
    pad_prompts,
    prefill,
    sample,
)
from .model import MiniMaxM3, Trace

# (drafts [K], draft_probs [K, V] | None, target_probs [K+1, V], uniforms [K+1]) -> (accepted, token)
AcceptFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], tuple[int, int]]



class Drafter(Protocol):
    """What the loop needs from a drafter (`drafter.DSparkDrafter` is the real one; tests use toys)."""

    block_size: int  # most drafts one pass can propose
    capture_layer_ids: set[int]  # target layers the target forward must capture (`Trace(layers=...)`)

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        """A context cache with `rollback(lengths)`."""

    def add_context(self, target: MiniMaxM3, cache: Any, trace: Trace, positions: torch.Tensor) -> None:
        """Turn a target forward's captures at `positions` [B, T] into context rows."""

    def draft(self, target: MiniMaxM3, cache: Any, anchors: torch.Tensor, positions: torch.Tensor, num_tokens: int,
              sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """Propose `num_tokens` tokens after the anchors [B] at positions [B]."""


# ----------------------------------------------------------------------------------------------
# the acceptance rule (pure functions)


def sample_inverse_cdf(probs: torch.Tensor, u: float | torch.Tensor) -> int:
    """The token i whose interval [cdf[i-1], cdf[i]) of the cumulative distribution contains u.

    probs: [V] non-negative, meant to sum to 1 (no normalisation happens here); u in [0, 1).
    The cumulative sum is taken in fp64; tokens of probability 0 are never returned. If u is at or
    past the total mass (rounding), the last token of positive probability is returned.
    """
    p = probs.double()
    cdf = p.cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([float(u)], dtype=torch.float64, device=cdf.device), right=True))
    if i >= p.numel():
        i = int(p.nonzero().max())
    return i


def accept_greedy(drafts: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """Greedy verification.

    drafts: [K] proposed ids, drafts[i] for the position after target position i.
    target_argmax: [K+1] the target's argmax at the K+1 verified positions.
    Returns (j, token): j = the number of leading drafts equal to the target's argmax at the
    previous position (drafts[i] == target_argmax[i]); token = target_argmax[j] (the correction at
    the first mismatch, or the bonus token when all K are accepted).
    """
    K = drafts.shape[0]
    mismatch = (drafts != target_argmax[:K]).nonzero()
    j = int(mismatch[0]) if mismatch.numel() else K
    return j, int(target_argmax[j])


def accept_drafts(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                  uniforms: torch.Tensor) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for one sequence.

    Args:
        drafts: [K] drafted ids; drafts[i] was sampled from draft_probs[i].
        draft_probs: [K, V] the draft distributions q_i (after the same temperature / top-k / top-p as
            the target), or None for point masses on the drafts (a greedy drafter).
        target_probs: [K+1, V] the target's distributions p_i at the K+1 verified positions.
        uniforms: [K+1] independent U[0, 1) draws: uniforms[i] decides draft i, uniforms[K] draws
            the emitted token.

    Returns (j, token): j accepted drafts, then one emitted token.
        * draft i is accepted iff `uniforms[i] * q_i(d_i) < p_i(d_i)`, i.e. with probability
          min(1, p_i(d_i) / q_i(d_i)); the first rejection ends the scan;
        * at a rejection at i, token = sample_inverse_cdf(r, uniforms[K]) with the residual
          r = max(0, p_i - q_i) / sum(max(0, p_i - q_i)) (if that sum is 0, which exact arithmetic rules
          out after a rejection, r = p_i);
        * if all K are accepted, token = sample_inverse_cdf(p_K, uniforms[K]) (the bonus token).
    The accepted drafts plus the token are then distributed exactly as K' <= K+1 tokens sampled one
    at a time from the target. Deterministic given its inputs.
    """
    K = drafts.shape[0]
    u_draw = uniforms[K]
    for i in range(K):
        d = int(drafts[i])
        p = target_probs[i].double()
        q = (torch.nn.functional.one_hot(drafts[i], p.numel()).double() if draft_probs is None
             else draft_probs[i].double())
        if float(uniforms[i]) * float(q[d]) < float(p[d]):
            continue
        residual = (p - q).clamp(min=0)
        mass = residual.sum()
        residual = residual / mass if mass > 0 else p
        return i, sample_inverse_cdf(residual, u_draw)
    return K, sample_inverse_cdf(target_probs[K], u_draw)


# ----------------------------------------------------------------------------------------------
# statistics


@dataclass
class SpeculativeStats(GenerationStats):
    """GenerationStats plus acceptance. A "step" is one (row, verify pass) with k >= 1 drafts.

    mean_accepted_length: tokens emitted per step before stop/length truncation (accepted drafts + the
        target's own token), in [1, k+1].
    acceptance_rate_per_position[i]: fraction of the steps that proposed draft i in which draft i was
        accepted (unconditional on the earlier positions, as vLLM reports it).
    draft_seconds: drafter passes plus context-row projection of the verify captures;
    verify_seconds: the target's verify forwards (both inside decode_seconds).
    """

    num_speculative_tokens: int = 0
    steps: int = 0
    emitted_in_steps: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted_in_steps / self.steps if self.steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float | None]:
        return [a / p if p else None for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update({"num_speculative_tokens": self.num_speculative_tokens, "speculative_steps": self.steps,
                  "mean_accepted_length": round(self.mean_accepted_length, 4),
                  "acceptance_rate_per_position": [None if r is None else round(r, 4)
                                                   for r in self.acceptance_rate_per_position],
                  "draft_seconds": round(self.draft_seconds, 6), "verify_seconds": round(self.verify_seconds, 6)})
        return d


# ----------------------------------------------------------------------------------------------
# the loop


def _now(device: torch.device) -> float:
    """A timestamp after the device's queued work (so draft and verify times are not launch times)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpeculativeDecoder:
    """Speculative generation for `model` with `drafter` (a `drafter.DSparkDrafter`, or any `Drafter`).

    num_speculative_tokens: drafts verified per step, 1..block_size (default: the block size).
    confidence_threshold: None (default) verifies all drafts; a value cuts each row's drafts before
        the first one whose confidence score is below it (drafters without a confidence head: no cut).
    accept_fn: the sampling acceptance rule (default `accept_drafts`; tests substitute wrong rules).

    After `generate`, `target_cache`, `draft_cache` and `lengths` (committed positions per row) hold
    the final state, for inspection.
    """

    def __init__(self, model: MiniMaxM3, drafter: Drafter, *, num_speculative_tokens: int | None = None,
                 confidence_threshold: float | None = None, accept_fn: AcceptFn = accept_drafts):
        n = drafter.block_size if num_speculative_tokens is None else num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= drafter.block_size:
            raise InputError(f"num_speculative_tokens={num_speculative_tokens!r}: must be an integer in "
                             f"[1, {drafter.block_size}] (the drafter's block size)")
        self.model, self.drafter = model, drafter
        self.num_speculative_tokens = n
        self.confidence_threshold = confidence_threshold
        self.accept_fn = accept_fn
        self.target_cache = self.draft_cache = self.lengths = None

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """A target forward at positions `pos` that also writes the drafter's context rows."""
        trace = Trace(layers=self.drafter.capture_layer_ids)
        logits = self.model(ids, positions=pos, cache=self.target_cache, trace=trace, inputs_embeds=embeds)
        self.drafter.add_context(self.model, self.draft_cache, trace, pos)
        return logits

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, seed: int = 0, stop_ids: Sequence[int] = (),
                 max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, on_token: Callable[[int, int], None] | None = None,
                 inputs_embeds: list[torch.Tensor | None] | None = None) -> tuple[list[Sequence_], SpeculativeStats]:
        """Generate for a batch of token-id prompts; the arguments and results are `generate_ids`'s
        (sampling: default `SamplingParams()`)."""
        model, drafter, N = self.model, self.drafter, self.num_speculative_tokens
        sampling = sampling or SamplingParams()
        rt = getattr(model, "runtime", None)
        max_len = max_seq_len or (rt.max_seq_len if rt else 4096)
        kv_dtype = kv_cache_dtype or (rt.kv_cache_dtype if rt else "auto")
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens={max_new_tokens}: must be >= 0")
        _check_prompts(prompts, model.text.vocab_size, max_len)
        device = model.device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        seqs = [Sequence_(list(map(int, p))) for p in prompts]
        stats = SpeculativeStats(prompt_tokens=sum(len(p) for p in prompts), num_speculative_tokens=N,
                                 proposed_per_position=[0] * N, accepted_per_position=[0] * N)
        B = len(seqs)
        lengths = [len(s.prompt) for s in seqs]
        T = max(lengths)
        budget = min(max_len, T + max_new_tokens)
        # Verify passes write up to k+1 slots past a row's length; finished rows ride along.
        slots = budget + N + 1
        self.target_cache = model.new_cache(B, slots, kv_dtype)
        self.draft_cache = drafter.new_cache(B, slots)
        ids, lengths, embeds = pad_prompts(model, seqs, inputs_embeds)

        # ---- prefill: every prompt position becomes a context row
        t0 = time.perf_counter()
        last_logits = prefill(self._forward, ids, lengths, embeds, prefill_chunk)
        self._rollback(lengths)  # forget the padding of shorter prompts
        stats.prefill_seconds = time.perf_counter() - t0

        stop = set(int(i) for i in stop_ids)
        active = [True] * B
        anchors = torch.zeros(B, dtype=torch.long, device=device)

        def emit(b: int, tokens: list[int]) -> int:
            """Append tokens to row b until it finishes; returns how many were taken."""
            s = seqs[b]
            for n, tok in enumerate(tokens, start=1):
                s.generated.append(tok)
                stats.generated_tokens += 1
                if on_token:
                    on_token(b, tok)
                if tok in stop:
                    s.finish_reason, active[b] = "stop", False
                elif len(s.prompt) + len(s.generated) >= budget or len(s.generated) >= max_new_tokens:
                    s.finish_reason, active[b] = "length", False
                if not active[b]:
                    return n
            return len(tokens)

        t1 = time.perf_counter()
        if max_new_tokens > 0:
            first = sample(last_logits, sampling, gen)
            for b in range(B):
                emit(b, [int(first[b])])
            anchors = first.to(device)
        else:
            active = [False] * B
        while any(active):
            # drafts this step: no more than any active row may still emit minus its own target token
            room = max(min(max_new_tokens - len(s.generated), budget - len(s.prompt) - len(s.generated))
                       for s, a in zip(seqs, active) if a)
            k = min(N, room - 1)
            t = torch.tensor(lengths, device=device)
            td = _now(device)
            draft = None
            drafts = torch.zeros(B, 0, dtype=torch.long, device=device)
            if k > 0:
                draft = drafter.draft(model, self.draft_cache, anchors, t, k, sampling, gen)
                drafts = draft.tokens
            tv = _now(device)
            pos = t[:, None] + torch.arange(k + 1, device=device)
            verify_ids = torch.cat((anchors[:, None], drafts), dim=1)
            trace = Trace(layers=drafter.capture_layer_ids)
            logits = model(verify_ids, positions=pos, cache=self.target_cache, trace=trace)
            tc = _now(device)
            drafter.add_context(model, self.draft_cache, trace, pos)
            stats.draft_seconds += (tv - td) + (_now(device) - tc)
            stats.verify_seconds += tc - tv
            stats.decode_steps += 1

            proposed = self._proposed(draft, k, B)
            if sampling.greedy:
                argmax = logits.argmax(-1)
            else:
                p = filtered_probs(logits, sampling)
                u = torch.rand(B, k + 1, generator=gen)
            for b in range(B):
                if not active[b]:
                    continue
                n_prop = proposed[b]
                if sampling.greedy:
                    j, tok = accept_greedy(drafts[b, :n_prop], argmax[b, : n_prop + 1])
                else:
                    q = None if draft is None or draft.probs is None else draft.probs[b, :n_prop]
                    j, tok = self.accept_fn(drafts[b, :n_prop], q, p[b, : n_prop + 1], u[b, : n_prop + 1])
                if k > 0:
                    stats.steps += 1
                    stats.emitted_in_steps += j + 1
                    for i in range(n_prop):
                        stats.proposed_per_position[i] += 1
                        stats.accepted_per_position[i] += int(i < j)
                taken = emit(b, drafts[b, :j].tolist() + [tok])
                # positions t..t+taken-1 (the anchor and the kept drafts) stay; the last token taken
                # is the next anchor at position t+taken
                lengths[b] += taken
                anchors[b] = seqs[b].generated[-1]
            self._rollback(lengths)
        for s in seqs:
            if s.finish_reason is None:
                s.finish_reason = "length"
        stats.decode_seconds = time.perf_counter() - t1
        self.lengths = lengths
        return seqs, stats

    def _proposed(self, draft: Draft | None, k: int, B: int) -> list[int]:
        """Drafts each row verifies: k, or fewer when a confidence threshold cuts the row's prefix."""
        if draft is None or self.confidence_threshold is None or draft.confidence is None:
            return [k] * B
        low = draft.confidence[:, :k] < self.confidence_threshold
        # the first low-confidence position, or k when there is none
        first = torch.where(low.any(-1), low.float().argmax(-1), torch.full((B,), k, device=low.device))
        return first.tolist()

    def _rollback(self, lengths: list[int]) -> None:
        self.target_cache.rollback(lengths)
        self.draft_cache.rollback(lengths)


def speculative_generate_ids(model: MiniMaxM3, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
                             num_speculative_tokens: int | None = None, confidence_threshold: float | None = None,
                             accept_fn: AcceptFn = accept_drafts, **kwargs) -> tuple[list[Sequence_], SpeculativeStats]:
    """`generate_ids` with speculative decoding; keyword arguments as `generate_ids` (max_new_tokens,
    sampling, seed, stop_ids, max_seq_len, kv_cache_dtype, prefill_chunk, on_token, inputs_embeds)."""
    decoder = SpeculativeDecoder(model, drafter, num_speculative_tokens=num_speculative_tokens,
                                 confidence_threshold=confidence_threshold, accept_fn=accept_fn)
    return decoder.generate(prompts, **kwargs)


__all__ = ["accept_drafts", "accept_greedy", "sample_inverse_cdf", "Drafter", "SpeculativeDecoder", "SpeculativeStats",
           "speculative_generate_ids"]
