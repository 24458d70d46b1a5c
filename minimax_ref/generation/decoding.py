"""Decoding token-id prompts: the checked arguments, the per-sequence decode state, and the plain loop.

The plain loop (`generate_ids`) and the speculative loop (`speculative.SpeculativeDecoder`) share all
their bookkeeping here:

* `DecodeJob.make` checks the arguments once (prompt types, lengths and ids, `max_new_tokens`, stop
  ids, seed, image embeddings) and resolves the limits from `model.runtime`. A batch larger than
  `runtime.max_batch_size` runs in groups of at most that many prompts (`run_in_groups`), group g0..
  seeded with `seed + g0`.
* `DecodeState` holds one batch: the right-padded prompts (MSA blocks are anchored to absolute
  positions, so only right padding is exact), the sequences, the seeded generator and the statistics.
  `emit` appends tokens to a row and applies the stop rules: a row finishes with "stop" at a stop
  token (the token is kept in `generated`) and with "length" once it has `max_new_tokens` tokens or
  prompt + generated reaches the budget min(max_seq_len, longest prompt + max_new_tokens); tokens
  after that are dropped. `committed(b)` is the number of positions of row b the target has
  processed and kept: the prompt, then every emitted token but the last (which is fed next).
* Prompts are prefilled in chunks of at most `prefill_chunk` positions (`prefill`), then the loop
  decodes one token per step for every row, each at its own position; finished rows ride along (a
  static batch) and write only into their own slots past their committed length.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..errors import InputError
from .sampling import SamplingParams, sample

if TYPE_CHECKING:
    from ..model.decoder import MiniMaxM3

PREFILL_CHUNK = 2048
DEFAULT_MAX_SEQ_LEN = 4096  # for models without runtime settings (`model.runtime`)

TokenCallback = Callable[[int, int], None]


@dataclass
class Sequence_:
    """One prompt's decoding: the prompt ids, the generated ids and, once finished, why ("stop" / "length")."""

    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    """Counts and wall times of one `generate` call (summed over its groups).

    prefill_seconds: the prompts' forward passes. first_token_seconds: from the start of the prefill to the first
    token chosen (time to first token; the first group's). warmup_seconds: the first decode step of each group,
    timed apart because on the fast paths it compiles the step and captures it in a CUDA graph.
    decode_seconds / decode_steps / decode_tokens: the other decode steps and the tokens they chose, which give
    `decode_tokens_per_s`. Host clocks: every step reads its sampled tokens back, so each is complete when timed.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    warmup_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def merge(self, other: GenerationStats) -> None:
        """Add the counts and times of another group of the same call (time to first token stays the first's)."""
        for f in ("prompt_tokens", "generated_tokens", "prefill_seconds", "warmup_seconds", "decode_seconds",
                  "decode_steps", "decode_tokens"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "prefill_seconds": round(self.prefill_seconds, 6),
                "time_to_first_token_seconds": round(self.first_token_seconds, 6),
                "warmup_seconds": round(self.warmup_seconds, 6),
                "decode_seconds": round(self.decode_seconds, 6), "decode_steps": self.decode_steps,
                "decode_tokens": self.decode_tokens,
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3)}


Stats = TypeVar("Stats", bound=GenerationStats)


# ----------------------------------------------------------------------------------------------
# argument checks


def _type(x: object) -> str:
    return type(x).__name__


def _as_int(x: object) -> int | None:
    """x as an int if it is an integer (Python, NumPy or a 0-d integer tensor; not a bool), else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def token_prompts(prompts: Any, where: str = "prompts") -> list[list[int]]:
    """`prompts` as a list of token-id lists: a list or tuple of prompts, each a list, tuple or 1-d
    tensor of integer ids, or a 2-d integer tensor [B, T]. Anything else (text, one flat prompt,
    non-integer ids) is an InputError naming `where`."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise InputError(f"{where}: a tensor of prompts must be 2-d integer token ids [batch, length], got "
                             f"{prompts.dim()}-d {prompts.dtype}")
        return prompts.tolist()
    if isinstance(prompts, (str, bytes)):
        raise InputError(f"{where}: got text; this function takes token ids (encode the text with the "
                         "tokenizer, or use minimax_ref.generation.generate for text)")
    if not isinstance(prompts, (list, tuple)):
        raise InputError(f"{where}: expected a list of token-id prompts, got {_type(prompts)}")
    if prompts and all(_as_int(p) is not None for p in prompts):
        raise InputError(f"{where}: got one flat list of token ids; pass a list of prompts: [ids]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor) and p.dim() == 1 and not p.is_floating_point():
            p = p.tolist()
        if not isinstance(p, (list, tuple)):
            raise InputError(f"{where}[{i}]: expected a list of token ids, got {_type(p)}")
        ids = [_as_int(t) for t in p]
        bad = next((j for j, t in enumerate(ids) if t is None), None)
        if bad is not None:
            raise InputError(f"{where}[{i}]: item {bad} is {p[bad]!r} ({_type(p[bad])}), not an integer token id")
        out.append(ids)
    return out


def stop_id_set(stop_ids: Any, where: str = "stop_ids") -> frozenset[int]:
    """Stop token ids: one integer, or a list / tuple / set of integers (empty: no stop token)."""
    if stop_ids is None:
        return frozenset()
    one = _as_int(stop_ids)
    if one is not None:
        return frozenset([one])
    if isinstance(stop_ids, torch.Tensor):
        stop_ids = stop_ids.flatten().tolist()
    if not isinstance(stop_ids, (list, tuple, set, frozenset)):
        raise InputError(f"{where}: expected a token id or a list of token ids, got {_type(stop_ids)}")
    ids = [_as_int(t) for t in stop_ids]
    bad = [t for t, i in zip(stop_ids, ids) if i is None]
    if bad:
        raise InputError(f"{where}: {bad[0]!r} ({_type(bad[0])}) is not an integer token id")
    return frozenset(ids)


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int, max_len: int) -> None:
    """Every prompt has 1..max_len-1 tokens, all in [0, vocab)."""
    if not prompts:
        raise InputError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty: give at least one token")
        if len(p) >= max_len:
            raise InputError(f"prompt {i} has {len(p)} tokens but the maximum sequence length is {max_len} "
                             "(raise --max-model-len / max_seq_len, or shorten the prompt)")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def _integer(value: Any, name: str, minimum: int | None = None) -> int:
    n = _as_int(value)
    if n is None or (minimum is not None and n < minimum):
        raise InputError(f"{name}={value!r}: must be an integer" + ("" if minimum is None else f" >= {minimum}"))
    return n


@dataclass(frozen=True)
class DecodeJob:
    """The checked arguments of one generation call; both loops take the same ones (`make`)."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    max_len: int
    kv_cache_dtype: str
    prefill_chunk: int
    on_token: TokenCallback | None
    inputs_embeds: list[torch.Tensor | None] | None
    batch_limit: int

    @classmethod
    def make(cls, model: MiniMaxM3, prompts: Any, *, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
             seed: int = 0, stop_ids: Any = (), max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
             prefill_chunk: int = PREFILL_CHUNK, on_token: TokenCallback | None = None,
             inputs_embeds: list[torch.Tensor | None] | None = None) -> DecodeJob:
        """Check the arguments of `generate_ids` (documented there); InputError names the bad one."""
        rt = getattr(model, "runtime", None)
        max_len = _integer(max_seq_len or (rt.max_seq_len if rt else DEFAULT_MAX_SEQ_LEN), "max_seq_len", minimum=2)
        kv_dtype = kv_cache_dtype or (rt.kv_cache_dtype if rt else "auto")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise InputError(f"sampling: expected a SamplingParams, got {_type(sampling)}")
        max_new_tokens = _integer(max_new_tokens, "max_new_tokens", minimum=0)
        seed = _integer(seed, "seed")
        prefill_chunk = _integer(prefill_chunk, "prefill_chunk", minimum=1)
        ids = token_prompts(prompts)
        check_prompts(ids, model.text.vocab_size, max_len)
        if inputs_embeds is not None:
            _check_embeds(inputs_embeds, ids)
        return cls(ids, max_new_tokens, sampling, seed, stop_id_set(stop_ids), max_len, kv_dtype, prefill_chunk,
                   on_token, inputs_embeds, rt.max_batch_size if rt else len(ids))

    def groups(self) -> list[DecodeJob]:
        """The job split into groups of at most `batch_limit` prompts: group g0.. is seeded with
        `seed + g0` and reports its rows to `on_token` as g0 + row."""
        n = self.batch_limit
        if len(self.prompts) <= n:
            return [self]
        out = []
        for g0 in range(0, len(self.prompts), n):
            cb = self.on_token
            out.append(replace(self, prompts=self.prompts[g0:g0 + n], seed=self.seed + g0,
                               on_token=None if cb is None else (lambda row, tok, g0=g0, cb=cb: cb(g0 + row, tok)),
                               inputs_embeds=None if self.inputs_embeds is None else self.inputs_embeds[g0:g0 + n]))
        return out


def _check_embeds(inputs_embeds: Any, prompts: list[list[int]]) -> None:
    """One entry per prompt: None or a [len(prompt), hidden] tensor (the hidden size is checked by `pad_prompts`)."""
    if not isinstance(inputs_embeds, (list, tuple)) or len(inputs_embeds) != len(prompts):
        n = len(inputs_embeds) if isinstance(inputs_embeds, (list, tuple)) else _type(inputs_embeds)
        raise InputError(f"inputs_embeds: give one entry per prompt ([len, hidden] tensor or None), got {n} "
                         f"for {len(prompts)} prompts")
    for i, (e, p) in enumerate(zip(inputs_embeds, prompts)):
        if e is not None and (not isinstance(e, torch.Tensor) or e.dim() != 2 or e.shape[0] != len(p)):
            shape = list(e.shape) if isinstance(e, torch.Tensor) else _type(e)
            raise InputError(f"inputs_embeds[{i}]: expected a [{len(p)}, hidden] tensor (one row per prompt "
                             f"token), got {shape}")


def run_in_groups(job: DecodeJob, run: Callable[[DecodeJob], tuple[list[Sequence_], Stats]]
                  ) -> tuple[list[Sequence_], Stats]:
    """`run(group)` for each group of `job.groups()`; the sequences in order and the merged stats."""
    seqs: list[Sequence_] = []
    total = None
    for group in job.groups():
        s, st = run(group)
        seqs += s
        if total is None:
            total = st
        else:
            total.merge(st)
    return seqs, total


# ----------------------------------------------------------------------------------------------
# one batch


class DecodeState:
    """The bookkeeping of one batch of `job` (at most `job.batch_limit` prompts).

    `ids` [B, T] are the right-padded prompts, `embeds` [B, T, H] their embeddings with
    `job.inputs_embeds` over the token embeddings (or None), `budget` the most positions any row
    may reach, `generator` the CPU generator seeded with `job.seed`. The caller times the run into
    `stats` (prefill_seconds, decode_seconds, decode_steps); `emit` counts the generated tokens.
    """

    def __init__(self, model: MiniMaxM3, job: DecodeJob, stats: GenerationStats):
        self.job = job
        self.seqs = [Sequence_(list(p)) for p in job.prompts]
        self.active = [job.max_new_tokens > 0] * len(self.seqs)
        self.budget = min(job.max_len, max(len(p) for p in job.prompts) + job.max_new_tokens)
        self.generator = torch.Generator(device="cpu").manual_seed(job.seed)
        self.stats = stats
        stats.prompt_tokens = sum(len(p) for p in job.prompts)
        self.ids, self.embeds = pad_prompts(model, job.prompts, job.inputs_embeds)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(s.prompt) for s in self.seqs]

    @property
    def done(self) -> bool:
        return not any(self.active)

    def active_rows(self) -> list[int]:
        return [b for b, a in enumerate(self.active) if a]

    def committed(self) -> list[int]:
        """Positions of each row the target has processed and keeps: the prompt and every emitted token
        but the last (the next one fed; the position it goes to)."""
        return [len(s.prompt) + max(0, len(s.generated) - 1) for s in self.seqs]

    def room(self, b: int) -> int:
        """How many more tokens row b may emit."""
        s = self.seqs[b]
        return min(self.job.max_new_tokens - len(s.generated), self.budget - len(s.prompt) - len(s.generated))

    def emit(self, b: int, tokens: Sequence[int]) -> int:
        """Append `tokens` to row b until it finishes (stop token, max_new_tokens, budget); calls
        `job.on_token(b, token)` for each one taken. Returns how many were taken."""
        s, job = self.seqs[b], self.job
        for n, tok in enumerate(tokens, start=1):
            s.generated.append(tok)
            self.stats.generated_tokens += 1
            if job.on_token:
                job.on_token(b, tok)
            if tok in job.stop_ids:
                s.finish_reason, self.active[b] = "stop", False
            elif len(s.prompt) + len(s.generated) >= self.budget or len(s.generated) >= job.max_new_tokens:
                s.finish_reason, self.active[b] = "length", False
            if not self.active[b]:
                return n
        return len(tokens)

    def emit_sampled(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row from `logits` [B, V] (every row, so the generator advances the
        same whoever is finished) and emit it to the active rows. Returns the tokens [B]."""
        tokens = sample(logits, self.job.sampling, self.generator)
        for b in self.active_rows():
            self.emit(b, [int(tokens[b])])
        return tokens

    def finish(self) -> list[Sequence_]:
        """The sequences, every unfinished one marked "length"."""
        for s in self.seqs:
            if s.finish_reason is None:
                s.finish_reason = "length"
        return self.seqs


def pad_prompts(model: MiniMaxM3, prompts: Sequence[Sequence[int]], inputs_embeds: list[torch.Tensor | None] | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad the prompts into ids [B, T] on the model's device (padding id 0). Returns (ids,
    embeddings [B, T, H] or None), the embeddings carrying `inputs_embeds[b]` (images) over the token
    embeddings where given."""
    device = model.device
    ids = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, device=device)
    embeds = None
    if inputs_embeds is not None and any(e is not None for e in inputs_embeds):
        embeds = model.embed(ids)
        for b, e in enumerate(inputs_embeds):
            if e is not None:
                if e.shape[-1] != embeds.shape[-1]:
                    raise InputError(f"inputs_embeds[{b}] has width {e.shape[-1]}, the model's hidden size is "
                                     f"{embeds.shape[-1]}")
                embeds[b, : e.shape[0]] = e.to(embeds.dtype)
    return ids, embeds


def prefill(forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor],
            ids: torch.Tensor, lengths: Sequence[int], embeds: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """Run `forward(ids_chunk, positions, embeds_chunk, logit_index) -> logits [B, 1, V]` over the padded prompts in
    chunks of `chunk` positions, asking each chunk for one position per row (`MiniMaxM3.forward`'s `logit_index`:
    the row's last prompt token where it lies in the chunk); return each row's logits at its last prompt token,
    [B, V] fp32."""
    B, T = ids.shape
    last: list[torch.Tensor | None] = [None] * B
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        pos = torch.arange(s0, s1, device=ids.device).expand(B, -1)
        index = torch.tensor([min(max(n - 1 - s0, 0), s1 - s0 - 1) for n in lengths], device=ids.device)
        logits = forward(ids[:, s0:s1], pos, None if embeds is None else embeds[:, s0:s1], index)
        for b in range(B):
            if s0 <= lengths[b] - 1 < s1:
                last[b] = logits[b, 0]
    return torch.stack(last)


# ----------------------------------------------------------------------------------------------
# the plain loop


def _decode(model: MiniMaxM3, job: DecodeJob) -> tuple[list[Sequence_], GenerationStats]:
    """One group: prefill, then one token per step for every row until all have finished."""
    state = DecodeState(model, job, GenerationStats())
    stats = state.stats
    # A fast model may round the length up (its compiled steps are specialised on the cache length).
    cache = model.new_cache(state.batch_size, state.budget, job.kv_cache_dtype)

    t0 = time.perf_counter()
    last_logits = prefill(lambda x, pos, emb, index: model(x, positions=pos, cache=cache, inputs_embeds=emb,
                                                           logit_index=index),
                          state.ids, state.prompt_lengths, state.embeds, job.prefill_chunk)
    stats.prefill_seconds = time.perf_counter() - t0
    if state.done:  # max_new_tokens 0
        return state.finish(), stats
    nxt = state.emit_sampled(last_logits)
    stats.first_token_seconds = time.perf_counter() - t0

    while not state.done:
        t1, before = time.perf_counter(), stats.generated_tokens
        pos = torch.tensor(state.committed(), device=model.device).clamp(max=state.budget - 1)[:, None]
        nxt = state.emit_sampled(model.step(nxt[:, None], pos, cache)[:, 0])
        seconds = time.perf_counter() - t1
        if stats.decode_steps == 0:
            stats.warmup_seconds = seconds
        else:
            stats.decode_seconds += seconds
            stats.decode_tokens += stats.generated_tokens - before
        stats.decode_steps += 1
    return state.finish(), stats


@torch.no_grad()
def generate_ids(model: MiniMaxM3, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, seed: int = 0, stop_ids: Sequence[int] | int = (),
                 max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, on_token: TokenCallback | None = None,
                 inputs_embeds: list[torch.Tensor | None] | None = None) -> tuple[list[Sequence_], GenerationStats]:
    """Generate for a batch of token-id prompts. Returns per-prompt sequences and statistics.

    prompts: a list of token-id lists (or a 2-d integer tensor); one prompt is `[ids]`.
    sampling: default `SamplingParams()` (temperature 1, no top-k / top-p).
    stop_ids: a token id or a list of them. max_seq_len / kv_cache_dtype: default `model.runtime`'s.
    on_token(row, token_id) is called as each token is chosen (for streaming).
    inputs_embeds: optional per-prompt [len, H] embeddings replacing the token embeddings
    (images); rows without them use the token embeddings.
    Bad arguments raise InputError naming the argument.
    """
    job = DecodeJob.make(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                         stop_ids=stop_ids, max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype,
                         prefill_chunk=prefill_chunk, on_token=on_token, inputs_embeds=inputs_embeds)
    return run_in_groups(job, lambda group: _decode(model, group))


__all__ = ["PREFILL_CHUNK", "DecodeJob", "DecodeState", "GenerationStats", "Sequence_", "check_prompts",
           "generate_ids", "pad_prompts", "prefill", "run_in_groups", "stop_id_set", "token_prompts"]
