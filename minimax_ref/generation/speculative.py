"""Speculative decoding: a drafter proposes tokens, the target verifies them in one forward.

The loop (spec `dspark.md`, "Verification") runs on the plain loop's continuous batching
(`decoding.Scheduler`, here `SpeculativeScheduler`): up to `batch_limit` requests verify together, each in
its own slot of the target's KV cache and of the drafter's context cache, at its own positions.

1. Admission: a request taking a free slot has its prompt prefilled into that slot's rows of the target's
   cache with a `Trace` capturing the drafter's target layers; every prompt position becomes a context
   row of the drafter in the same slot (`drafter.add_context`). The first token is sampled from the last
   prompt position's logits exactly as `decoding.generate_ids` does; it is the first anchor.
2. Each step, per slot: the anchor `a` sits at position t = the request's committed length (the number
   of positions the target has processed and kept). The drafter proposes d_0..d_{k-1} (d_i for position
   t+i+1); the target runs `[a, d_0..d_{k-1}]` at positions t..t+k in ONE step (each slot at its own
   positions, `MiniMaxM3.step_with_hidden`: on the GPU fast paths replayed from a CUDA graph) and
   returns the logits of all k+1 positions and the drafter's layers' residual streams.
3. Acceptance per request (`accept_greedy` / `accept_drafts`): j drafts are accepted and one more token is
   emitted (the correction at the first rejection, or the bonus token when all k are accepted), so a
   step emits j+1 tokens. Greedy output is token-identical to plain greedy decoding; sampled output
   has exactly the target's distribution.
4. Rollback: positions t..t+j are kept (the anchor and the accepted drafts), so the target's KV and
   index-key caches and the drafter's context cache are rolled back to length t+j+1; the verify pass's
   captures of those j+1 positions are the new context rows (the last of them is the row whose logits
   produced the emitted token). The emitted token is the next anchor, at position t+j+1.

The argument checks, padding, stop tokens, `max_new_tokens` and the maximum length are the plain
loop's own (`decoding.DecodeJob`, `decoding.Scheduler`): tokens past a stop token or the limits are
dropped and the caches keep only the request's committed positions (all but its last emitted token),
so after a run each slot's rows equal those of a plain run over `prompt + generated[:-1]` of the last
request that ran in it (`SpeculativeDecoder.held`).

When a request finishes, the next waiting one takes its slot between two steps, so the batch stays full
until the queue is empty. Every step drafts and verifies k = `num_speculative_tokens` (default: the
drafter's block size) in every slot, so every verify step has one shape, k+1 tokens a slot (on the GPU
fast paths: one CUDA graph per batch size). Near the end a request verifies only as many drafts as it
may still emit minus one (its own target token); the others are rolled back with the rejected ones. A
free slot verifies a block of padding at its frozen length (the positions of the request it last held)
and is rolled back to it. An optional confidence threshold verifies, per request, only the drafts before
the first one whose confidence score is below it; this changes how many tokens a step may emit, never
which (off by default).

Sampling randomness: request i has its own CPU `torch.Generator`, seeded with its own seed (`seeds[i]`,
default `seed + i`) as it is admitted, and its own sampling setting (`sampling.RowSampling`). From it
come, in order, its first token (as `decoding.generate_ids`), then per step the drafter's k samples of
its row and k+1 uniforms for the acceptance rule (a greedy request draws nothing). What it draws does not
depend on which requests share its batch, so neither do its tokens (in fp32 on a CPU: the same tokens
alone and in a batch), and every tensor-parallel rank makes the same decisions.
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
from .decoding import DecodeJob, FinishCallback, GenerationStats, Scheduler, Sequence_, TokenCallback
from .drafter import Draft
from .sampling import RowSampling, SamplingParams, sample_inverse_cdf

# (drafts [K], draft_probs [K, V] | None, target_probs [K+1, V], uniforms [K+1]) -> (accepted, token)
AcceptFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], tuple[int, int]]


class Drafter(Protocol):
    """What the loop needs from a drafter (`drafter.DSparkDrafter` is the real one; tests use toys)."""

    block_size: int  # most drafts one pass can propose
    capture_layer_ids: set[int]  # target layers whose residual streams the drafter reads

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        """A context cache with `rollback(lengths)` and `rows(start, stop)` (a view of those sequences)."""

    def add_context(self, target: MiniMaxM3, cache: Any, hidden: Mapping[int, torch.Tensor],
                    positions: torch.Tensor) -> None:
        """Turn a target forward's residual streams after `capture_layer_ids` ({layer: [B, T, H]}) at `positions`
        [B, T] into context rows."""

    def draft(self, target: MiniMaxM3, cache: Any, anchors: torch.Tensor, positions: torch.Tensor, num_tokens: int,
              sampling: SamplingParams | RowSampling, generator: torch.Generator | None) -> Draft:
        """Propose `num_tokens` tokens after the anchors [B] at positions [B]; the loop passes a `RowSampling` (each
        row samples with its own setting from its own generator) and no generator."""


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
    """GenerationStats plus acceptance. A "step" is one (request, verify pass) in which the request may still take
    a draft (it may emit at least two more tokens).

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
    confidence_threshold: None (default) verifies all drafts; a value cuts each request's drafts before
        the first one whose confidence score is below it (drafters without a confidence head: no cut).
    accept_fn: the sampling acceptance rule (default `accept_drafts`; tests substitute wrong rules).

    After `generate`, `target_cache`, `draft_cache` and `lengths` (committed positions per slot) hold the run's
    final state, for inspection: slot s holds the positions of request `held[s]`, the last one that ran in it.
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
        self.target_cache = self.draft_cache = self.lengths = self.held = None

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 128,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, seed: int | Sequence[int] = 0,
                 stop_ids: Sequence[int] | int = (), max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                 prefill_chunk: int | None = None, on_token: TokenCallback | None = None,
                 inputs_embeds: list[torch.Tensor | None] | None = None, max_batch_size: int | None = None,
                 on_finish: FinishCallback | None = None, vocab_limit: int | None = None
                 ) -> tuple[list[Sequence_], SpeculativeStats]:
        """Generate for token-id prompts; the arguments, checks and results are `decoding.generate_ids`'s
        (max_new_tokens, sampling and seed: one value or one per prompt; default `SamplingParams()`), decoded by
        continuous batching of at most `max_batch_size` requests (`SpeculativeScheduler`); on_finish(row, sequence)
        as each request finishes."""
        job = DecodeJob.make(self.model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                             stop_ids=stop_ids, max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype,
                             prefill_chunk=prefill_chunk, on_token=on_token, inputs_embeds=inputs_embeds,
                             max_batch_size=max_batch_size, vocab_limit=vocab_limit)
        scheduler = SpeculativeScheduler(self, job, on_finish)
        seqs, stats = scheduler.run()
        self.target_cache, self.draft_cache = scheduler.cache, scheduler.draft_cache
        self.lengths, self.held = scheduler.lengths, scheduler.held
        return seqs, stats


class SpeculativeScheduler(Scheduler):
    """`decoding.Scheduler` with the speculative step (module docstring): admission, sampling of the first token,
    emission and finishing are the plain loop's; each slot also has rows in the drafter's context cache, and a step
    drafts, verifies and accepts for every slot.

    `lengths[s]`: the positions slot s's rows of both caches keep; `held[s]`: the request they belong to (the one
    running there, or the last that did; None: none yet). A free slot keeps its last request's positions.
    """

    def __init__(self, decoder: SpeculativeDecoder, job: DecodeJob, on_finish: FinishCallback | None = None):
        self.decoder, self.drafter, self.k = decoder, decoder.drafter, decoder.num_speculative_tokens
        stats = SpeculativeStats(num_speculative_tokens=self.k, proposed_per_position=[0] * self.k,
                                 accepted_per_position=[0] * self.k)
        super().__init__(decoder.model, job, on_finish, stats)
        self.lengths = [0] * len(self.running)
        self.held: list[int | None] = [None] * len(self.running)

    def new_cache(self, slots: int, length: int) -> Any:
        """The target's KV cache, and the drafter's context cache as `draft_cache`: a verify step writes k+1
        positions from a slot's committed length, which is below `length`."""
        self.draft_cache = self.drafter.new_cache(slots, length + self.k + 1)
        return super().new_cache(slots, length + self.k + 1)

    def prompt_forward(self, start: int, stop: int
                       ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]:
        """The target's forward into slots start..stop-1 that also writes their context rows in the drafter's
        cache (a `Trace` of the drafter's target layers)."""
        cache, context = self.cache.rows(start, stop), self.draft_cache.rows(start, stop)
        model, drafter = self.model, self.drafter

        def forward(ids: torch.Tensor, pos: torch.Tensor, embeds: torch.Tensor | None,
                    index: torch.Tensor) -> torch.Tensor:
            trace = Trace(layers=drafter.capture_layer_ids)
            logits = model(ids, positions=pos, cache=cache, trace=trace, inputs_embeds=embeds, logit_index=index)
            drafter.add_context(model, context, trace.hidden_states, pos)
            return logits

        return forward

    def prefill(self, s0: int, requests: list[int]) -> torch.Tensor:
        """`Scheduler.prefill`, then each slot's rows of both caches rolled back to its prompt: the padding of
        shorter prompts, and what the slot's previous request left past the prompt, are forgotten."""
        logits = super().prefill(s0, requests)
        s1 = s0 + len(requests)
        for s, i in enumerate(requests, start=s0):
            self.lengths[s], self.held[s] = len(self.job.prompts[i]), i
        self.cache.rows(s0, s1).rollback(self.lengths[s0:s1])
        self.draft_cache.rows(s0, s1).rollback(self.lengths[s0:s1])
        return logits

    def decode(self) -> None:
        """One speculative step of every slot: the drafter proposes k tokens after each anchor, the target verifies
        [anchor, drafts] in one step of k+1 tokens a slot (its captures become context rows), each running request
        accepts (`accept`), and both caches are rolled back to what each slot keeps. A free slot's anchor is a
        padding token at its kept length, drafted greedily."""
        model, drafter, k, device, stats = self.model, self.drafter, self.k, self.model.device, self.stats
        anchors = torch.tensor([0 if i is None else self.seqs[i].generated[-1] for i in self.running], device=device)
        t = torch.tensor(self.lengths, device=device)
        sampling = self.row_sampling(self.running)
        td = _now(device)
        draft = drafter.draft(model, self.draft_cache, anchors, t, k, sampling, None)
        tv = _now(device)
        pos = t[:, None] + torch.arange(k + 1, device=device)
        verify_ids = torch.cat((anchors[:, None], draft.tokens), dim=1)
        logits, hidden = model.step_with_hidden(verify_ids, pos, self.cache, drafter.capture_layer_ids)
        tc = _now(device)
        drafter.add_context(model, self.draft_cache, hidden, pos)
        if stats.decode_steps:  # the first step is timed apart (`warmup_seconds`): it captures the verify step
            stats.draft_seconds += (tv - td) + (_now(device) - tc)
            stats.verify_seconds += tc - tv
        self.accept(draft, logits, sampling)
        self.cache.rollback(self.lengths)
        self.draft_cache.rollback(self.lengths)

    def accept(self, draft: Draft, logits: torch.Tensor, sampling: RowSampling) -> None:
        """Each running request's acceptance of its drafts against the verify step's `logits` [slots, k+1, V]: greedy
        ones by argmax (`accept_greedy`), sampled ones by `decoder.accept_fn` with k+1 uniforms from their own
        generator. Emits the accepted drafts and the target's token, and sets the slot's kept length."""
        k, stats, job = self.k, self.stats, self.job
        logits = job.choosable(logits)  # a draft of an id past the limit is then always rejected
        active = [s for s, i in enumerate(self.running) if i is not None]
        sampled = [s for s in active if not sampling.params[s].greedy]
        drafts = draft.tokens.cpu()
        argmax = logits.argmax(-1).cpu()
        probs = dict(zip(sampled, sampling.take(sampled).probs(logits[sampled]))) if sampled else {}
        proposed = self.proposed(draft)
        for s in active:
            i, seq = self.running[s], self.seqs[self.running[s]]
            # no more drafts than the request may still emit besides the target's own token
            room = job.budget(i) - len(seq.prompt) - len(seq.generated) - 1
            n = min(proposed[s], room)
            if s in probs:
                u = torch.rand(k + 1, generator=self.generators[i])
                q = None if draft.probs is None else draft.probs[s, :n]
                j, token = self.decoder.accept_fn(draft.tokens[s, :n], q, probs[s][:n + 1], u[:n + 1])
            else:
                j, token = accept_greedy(drafts[s, :n], argmax[s, :n + 1])
            if room > 0:
                stats.steps += 1
                stats.emitted_in_steps += j + 1
                for p in range(n):
                    stats.proposed_per_position[p] += 1
                    stats.accepted_per_position[p] += int(p < j)
            # the anchor and the kept drafts stay in the caches; the last token taken is the next anchor
            self.emit(s, drafts[s, :j].tolist() + [token])
            self.lengths[s] = self.committed(i)

    def proposed(self, draft: Draft) -> list[int]:
        """Drafts each slot verifies: k, or fewer when a confidence threshold cuts the slot's prefix."""
        k, B, threshold = self.k, len(self.running), self.decoder.confidence_threshold
        if threshold is None or draft.confidence is None:
            return [k] * B
        low = draft.confidence[:, :k] < threshold
        # the first low-confidence position, or k when there is none
        first = torch.where(low.any(-1), low.float().argmax(-1), torch.full((B,), k, device=low.device))
        return first.tolist()


def speculative_generate_ids(model: MiniMaxM3, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
                             num_speculative_tokens: int | None = None, confidence_threshold: float | None = None,
                             accept_fn: AcceptFn = accept_drafts, **kwargs) -> tuple[list[Sequence_], SpeculativeStats]:
    """`generate_ids` with speculative decoding; keyword arguments as `generate_ids` (max_new_tokens,
    sampling, seed, stop_ids, max_seq_len, kv_cache_dtype, prefill_chunk, on_token, inputs_embeds, max_batch_size,
    on_finish, vocab_limit)."""
    decoder = SpeculativeDecoder(model, drafter, num_speculative_tokens=num_speculative_tokens,
                                 confidence_threshold=confidence_threshold, accept_fn=accept_fn)
    return decoder.generate(prompts, **kwargs)


__all__ = ["accept_drafts", "accept_greedy", "sample_inverse_cdf", "Drafter", "SpeculativeDecoder",
           "SpeculativeScheduler", "SpeculativeStats", "speculative_generate_ids"]
