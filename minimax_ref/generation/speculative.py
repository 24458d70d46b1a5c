"""Speculative decoding: a drafter proposes tokens, the target verifies them in one forward.

The loop (spec `dspark.md`, "Verification"), for a batch of right-padded prompts of different lengths:

1. Prefill the target with a `Trace` capturing the drafter's target layers; every prompt position
   becomes a context row of the drafter (`drafter.add_context`). The first token is sampled from the
   last prompt position's logits exactly as `decoding.generate_ids` does; it is the first anchor.
2. Each step, per row: the anchor `a` sits at position t = the row's committed length (the number of
   positions the target has processed and kept). The drafter proposes d_0..d_{k-1} (d_i for position
   t+i+1); the target runs `[a, d_0..d_{k-1}]` at positions t..t+k in ONE step (each row at its
   own positions, `MiniMaxM3.step_with_hidden`: on the GPU fast paths replayed from a CUDA graph) and
   returns the logits of all k+1 positions and the drafter's layers' residual streams.
3. Acceptance per row (`accept_greedy` / `accept_drafts`): j drafts are accepted and one more token is
   emitted (the correction at the first rejection, or the bonus token when all k are accepted), so a
   step emits j+1 tokens. Greedy output is token-identical to plain greedy decoding; sampled output
   has exactly the target's distribution.
4. Rollback: positions t..t+j are kept (the anchor and the accepted drafts), so the target's KV and
   index-key caches and the drafter's context cache are rolled back to length t+j+1; the verify pass's
   captures of those j+1 positions are the new context rows (the last of them is the row whose logits
   produced the emitted token). The emitted token is the next anchor, at position t+j+1.

The argument checks, batch groups, padding, stop tokens, `max_new_tokens` and the maximum length are
the plain loop's own (`decoding.DecodeJob`, `decoding.DecodeState`): tokens past a stop token or the
limits are dropped and the caches keep only the row's committed positions (all but its last emitted
token), so after a run the caches equal those of a plain run over `prompt + generated[:-1]`.

Every step drafts and verifies k = `num_speculative_tokens` (default: the drafter's block size) for
the whole batch, so every verify step has one shape (on the GPU fast paths: one CUDA graph). Near the
end a row verifies only as many drafts as it may still emit minus one (its own target token); the
others are rolled back with the rejected ones. Finished rows ride along, as in `generate_ids`, and
are rolled back to their frozen length. An optional
confidence threshold verifies, per row, only the drafts before the first one whose confidence score
is below it; this changes how many tokens a step may emit, never which (off by default).

Sampling randomness comes from one `torch.Generator` seeded with `seed`: the first token (as
`sampling.sample`), the drafter's samples, then per step a [B, k+1] block of uniforms for the
acceptance rule. Every tensor-parallel rank therefore makes the same decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import InputError
from ..model.decoder import MiniMaxM3
from ..research.trace import Trace
from .decoding import (
    DecodeJob,
    DecodeState,
    FinishCallback,
    GenerationStats,
    Sequence_,
    TokenCallback,
    prefill,
    run_in_groups,
)
from .drafter import Draft
from .sampling import SamplingParams, filtered_probs, sample_inverse_cdf

# (drafts [K], draft_probs [K, V] | None, target_probs [K+1, V], uniforms [K+1]) -> (accepted, token)
AcceptFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], tuple[int, int]]


class Drafter(Protocol):
    """What the loop needs from a drafter (`drafter.DSparkDrafter` is the real one; tests use toys)."""

    block_size: int  # most drafts one pass can propose
    capture_layer_ids: set[int]  # target layers whose residual streams the drafter reads

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        """A context cache with `rollback(lengths)`."""

    def add_context(self, target: MiniMaxM3, cache: Any, hidden: Mapping[int, torch.Tensor],
                    positions: torch.Tensor) -> None:
        """Turn a target forward's residual streams after `capture_layer_ids` ({layer: [B, T, H]}) at `positions`
        [B, T] into context rows."""

    def draft(self, target: MiniMaxM3, cache: Any, anchors: torch.Tensor, positions: torch.Tensor, num_tokens: int,
              sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """Propose `num_tokens` tokens after the anchors [B] at positions [B]."""


# ----------------------------------------------------------------------------------------------
# the acceptance rule (pure functions)


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
    """GenerationStats plus acceptance. A "step" is one (row, verify pass) in which the row may still take a
    draft (it may emit at least two more tokens).

    mean_accepted_length: tokens emitted per step before stop/length truncation (accepted drafts + the
        target's own token), in [1, k+1].
    acceptance_rate_per_position[i]: fraction of the steps that proposed draft i in which draft i was
        accepted (unconditional on the earlier positions, as vLLM reports it).
    draft_seconds: drafter passes plus context-row projection of the verify captures;
    verify_seconds: the target's verify steps (both inside decode_seconds: the first step, which on the fast
    paths captures the verify step in a CUDA graph, is `warmup_seconds`).
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

    def merge(self, other: SpeculativeStats) -> None:  # type: ignore[override]
        super().merge(other)
        self.steps += other.steps
        self.emitted_in_steps += other.emitted_in_steps
        self.proposed_per_position = [a + b for a, b in zip(self.proposed_per_position, other.proposed_per_position)]
        self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)]
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

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
    the final state of its last batch group, for inspection.
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

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, embeds: torch.Tensor | None = None,
                 logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """A target forward at positions `pos` that also writes the drafter's context rows."""
        trace = Trace(layers=self.drafter.capture_layer_ids)
        logits = self.model(ids, positions=pos, cache=self.target_cache, trace=trace, inputs_embeds=embeds,
                            logit_index=logit_index)
        self.drafter.add_context(self.model, self.draft_cache, trace.hidden_states, pos)
        return logits

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 128,
                 sampling: SamplingParams | None = None, seed: int | Sequence[int] = 0,
                 stop_ids: Sequence[int] | int = (), max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                 prefill_chunk: int | None = None, on_token: TokenCallback | None = None,
                 inputs_embeds: list[torch.Tensor | None] | None = None, max_batch_size: int | None = None,
                 on_finish: FinishCallback | None = None) -> tuple[list[Sequence_], SpeculativeStats]:
        """Generate for a batch of token-id prompts; the arguments, checks and results are
        `decoding.generate_ids`'s (one sampling setting for all prompts; default `SamplingParams()`), decoded in
        static groups of at most `max_batch_size` prompts (a group's generator seeded with its first prompt's
        seed); on_finish(row, sequence) as each group ends."""
        job = DecodeJob.make(self.model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                             stop_ids=stop_ids, max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype,
                             prefill_chunk=prefill_chunk, on_token=on_token, inputs_embeds=inputs_embeds,
                             max_batch_size=max_batch_size)
        done = 0

        def run(group: DecodeJob) -> tuple[list[Sequence_], SpeculativeStats]:
            nonlocal done
            seqs, stats = self._decode(group)
            for row, seq in enumerate(seqs if on_finish else ()):
                on_finish(done + row, seq)
            done += len(seqs)
            return seqs, stats

        return run_in_groups(job, run)

    def _decode(self, job: DecodeJob) -> tuple[list[Sequence_], SpeculativeStats]:
        """One group: prefill with context capture, the first token, then draft / verify / accept steps."""
        model, drafter, N = self.model, self.drafter, self.num_speculative_tokens
        state = DecodeState(model, job, SpeculativeStats(num_speculative_tokens=N, proposed_per_position=[0] * N,
                                                         accepted_per_position=[0] * N,
                                                         max_batch_size=job.batch_limit,
                                                         prefill_chunk=job.prefill_chunk))
        sampling = state.sampling
        stats, B, device = state.stats, state.batch_size, model.device
        # Verify passes write up to k+1 slots past a row's length; finished rows ride along.
        slots = state.budget + N + 1
        self.target_cache = model.new_cache(B, slots, job.kv_cache_dtype)
        self.draft_cache = drafter.new_cache(B, slots)

        # ---- prefill: every prompt position becomes a context row
        t0 = time.perf_counter()
        last_logits = prefill(self._forward, state.ids, state.prompt_lengths, state.embeds, job.prefill_chunk)
        self._rollback(state.committed())  # forget the padding of shorter prompts
        stats.prefill_seconds = time.perf_counter() - t0

        anchors = torch.zeros(B, dtype=torch.long, device=device)
        if not state.done:
            anchors = state.emit_sampled(last_logits).to(device)
        stats.first_token_seconds = time.perf_counter() - t0
        while not state.done:
            t1, before = time.perf_counter(), stats.generated_tokens
            t = torch.tensor(state.committed(), device=device)
            td = _now(device)
            draft = drafter.draft(model, self.draft_cache, anchors, t, N, sampling, state.generator)
            drafts = draft.tokens
            tv = _now(device)
            pos = t[:, None] + torch.arange(N + 1, device=device)
            verify_ids = torch.cat((anchors[:, None], drafts), dim=1)
            logits, hidden = model.step_with_hidden(verify_ids, pos, self.target_cache, drafter.capture_layer_ids)
            tc = _now(device)
            drafter.add_context(model, self.draft_cache, hidden, pos)
            draft_seconds, verify_seconds = (tv - td) + (_now(device) - tc), tc - tv

            proposed = self._proposed(draft, N, B)
            if sampling.greedy:
                argmax = logits.argmax(-1)
            else:
                p = filtered_probs(logits, sampling)
                u = torch.rand(B, N + 1, generator=state.generator)
            for b in state.active_rows():
                # no more drafts than the row may still emit besides its own target token
                room = state.room(b) - 1
                n_prop = min(proposed[b], room)
                if sampling.greedy:
                    j, tok = accept_greedy(drafts[b, :n_prop], argmax[b, : n_prop + 1])
                else:
                    q = None if draft.probs is None else draft.probs[b, :n_prop]
                    j, tok = self.accept_fn(drafts[b, :n_prop], q, p[b, : n_prop + 1], u[b, : n_prop + 1])
                if room > 0:
                    stats.steps += 1
                    stats.emitted_in_steps += j + 1
                    for i in range(n_prop):
                        stats.proposed_per_position[i] += 1
                        stats.accepted_per_position[i] += int(i < j)
                # the anchor and the kept drafts stay in the caches; the last token taken is the next anchor
                state.emit(b, drafts[b, :j].tolist() + [tok])
                anchors[b] = state.seqs[b].generated[-1]
            self._rollback(state.committed())
            seconds = time.perf_counter() - t1
            if stats.decode_steps == 0:  # on the fast paths the first step captures the verify step
                stats.warmup_seconds = seconds
            else:
                stats.decode_seconds += seconds
                stats.decode_tokens += stats.generated_tokens - before
                stats.draft_seconds += draft_seconds
                stats.verify_seconds += verify_seconds
            stats.decode_steps += 1
        self.lengths = state.committed()
        return state.finish(), stats

    def _proposed(self, draft: Draft, k: int, B: int) -> list[int]:
        """Drafts each row verifies: k, or fewer when a confidence threshold cuts the row's prefix."""
        if self.confidence_threshold is None or draft.confidence is None:
            return [k] * B
        low = draft.confidence[:, :k] < self.confidence_threshold
        # the first low-confidence position, or k when there is none
        first = torch.where(low.any(-1), low.float().argmax(-1), torch.full((B,), k, device=low.device))
        return first.tolist()

    def _rollback(self, lengths: list[int]) -> None:
        """Forget every slot of row b at or past lengths[b] in both caches."""
        self.target_cache.rollback(lengths)
        self.draft_cache.rollback(lengths)


def speculative_generate_ids(model: MiniMaxM3, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
                             num_speculative_tokens: int | None = None, confidence_threshold: float | None = None,
                             accept_fn: AcceptFn = accept_drafts, **kwargs) -> tuple[list[Sequence_], SpeculativeStats]:
    """`generate_ids` with speculative decoding; keyword arguments as `generate_ids` (max_new_tokens,
    sampling, seed, stop_ids, max_seq_len, kv_cache_dtype, prefill_chunk, on_token, inputs_embeds, max_batch_size,
    on_finish)."""
    decoder = SpeculativeDecoder(model, drafter, num_speculative_tokens=num_speculative_tokens,
                                 confidence_threshold=confidence_threshold, accept_fn=accept_fn)
    return decoder.generate(prompts, **kwargs)


__all__ = ["accept_drafts", "accept_greedy", "sample_inverse_cdf", "Drafter", "SpeculativeDecoder", "SpeculativeStats",
           "speculative_generate_ids"]
