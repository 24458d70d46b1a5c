"""Decoding token-id prompts: the checked arguments, continuous batching, and the plain loop.

The plain loop (`generate_ids`) and the speculative loop (`speculative.SpeculativeDecoder`) share their
argument checks, stop rules and scheduler here:

* `DecodeJob.make` checks the arguments once (prompt types, lengths and ids, `max_new_tokens`, sampling and
  seed, each one value or one per prompt; stop ids, image embeddings) and resolves the limits from
  `model.runtime`. Request i's seed is `seeds[i]` (default `seed + i`).
* Tokens are chosen among ids below `vocab_limit` (default: every id of the model). Text generation passes the
  tokenizer's size: a checkpoint's `vocab_size` may be padded past its tokenizer, and a padding id has no text.
* A row finishes with "stop" at a stop token (the token is kept in `generated`): one of the job's, one of its own
  (`Stops.per_request`), or one after which `Stops.check` says so (`generate`'s stop strings); and with "length"
  once it has its `max_new_tokens` tokens or prompt + generated reaches `max_seq_len`; tokens after that are dropped.
* Seeds are integers in [-2**63, 2**64) (`SEED_MIN`, `SEED_MAX`: what a `torch.Generator` takes), `seed + i` too.

Both loops are continuous batching (`Scheduler`): up to `batch_limit` requests (`runtime.max_batch_size`, or
chosen from free memory with the prefill chunk: `sizing`) decode together, every row at its own position in its own
slot of one KV cache. When a row finishes, the next waiting request takes its slot between two decode steps: its
prompt is prefilled into that slot's rows of the cache (`KVCache.rows`) and its first token sampled; the batch stays
full until the queue is empty. The slots are the batch limit or the requests, whichever is fewer; a model that
compiles a step for each batch size rounds that up (`batch_slots`: a power of two within the limit), so calls of 3
and 4 requests share one compiled step; an empty slot decodes a token of its own that nothing reads. Requests
admitted together into neighbouring free slots (at the start, every slot) share their prefill forwards: right-padded
to the longest, as many as fit `prefill_chunk` tokens (a longer prompt goes alone, in chunks of at most
`prefill_chunk` positions), so short prompts do not each pay a forward of their own. The step's shape never
changes (the plain loop: one token for each of the slots; the speculative loop's verify step: k+1), so a fast model
captures one step per batch size. Each request samples from its own settings with its
own generator, seeded with its own seed (`sampling.RowSampling`), so its tokens do not depend on which requests
share its batch (up to the rounding of batched products: in fp32 on a CPU the same tokens).

The `Scheduler` does the admission, emission and finishing of requests, with the plain loop's step;
`speculative.SpeculativeScheduler` keeps those and replaces the step (draft, verify, accept) and what the slots hold.
"""
from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InputError
from ..model.config import RuntimeConfig
from .sampling import RowSampling, SamplingParams
from .sizing import choose_sizes

if TYPE_CHECKING:
    from ..model.decoder import MiniMaxM3

GREEDY = SamplingParams(temperature=0)

TokenCallback = Callable[[int, int], None]


@dataclass
class Sequence_:
    """One prompt's decoding: the prompt ids, the generated ids and, once finished, why ("stop" / "length");
    admitted_seconds / first_token_seconds / finish_seconds: when it took a slot (its prefill began), when its first
    token was chosen and when it finished, each counted from the start of the call (None where not timed). Its own
    time to first token is first_token_seconds - admitted_seconds; before admission it waited in the queue."""

    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_seconds: float | None = None
    finish_seconds: float | None = None
    admitted_seconds: float | None = None


@dataclass
class GenerationStats:
    """Counts and wall times of one `generate` call.

    prefill_seconds: the prompts' forward passes, summed. first_token_seconds: from the start of the call to the
    first token chosen (the first request's time to first token; each request's own is `Sequence_`'s).
    warmup_seconds: the first decode step, timed apart because on the fast paths it compiles the step and captures
    it in a CUDA graph.
    decode_seconds / decode_steps / decode_tokens: the other decode steps and the tokens they chose, which give
    `decode_tokens_per_s`. Host clocks: every step reads its sampled tokens back, so each is complete when timed.
    max_batch_size / prefill_chunk: the sizes the call ran with (given, or chosen from memory: `sizing`).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    warmup_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    max_batch_size: int = 0
    prefill_chunk: int = 0

    def count_step(self, seconds: float, tokens: int) -> None:
        """One decode step of `seconds` that chose `tokens` tokens: the first is the warm-up, the others add up."""
        if self.decode_steps == 0:
            self.warmup_seconds = seconds
        else:
            self.decode_seconds += seconds
            self.decode_tokens += tokens
        self.decode_steps += 1

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "prefill_seconds": round(self.prefill_seconds, 6),
                "time_to_first_token_seconds": round(self.first_token_seconds, 6),
                "warmup_seconds": round(self.warmup_seconds, 6),
                "decode_seconds": round(self.decode_seconds, 6), "decode_steps": self.decode_steps,
                "decode_tokens": self.decode_tokens, "max_batch_size": self.max_batch_size,
                "prefill_chunk": self.prefill_chunk,
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3)}


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


@dataclass(frozen=True)
class Stops:
    """Stop rules beyond one set of ids for every request, given as `stop_ids` (`generate` passes one): `ids` end
    every request; `per_request[i]` (one set per request, or None) ends request i too; `check(i, token)`, called with
    each token request i takes that no stop id ended, returns True to end it with "stop" (`generate`'s stop strings:
    the decoded text now holds one). Like a stop id, the token that ends it is kept in `generated`."""

    ids: Any = ()
    per_request: Sequence[Any] | None = None
    check: Callable[[int, int], bool] | None = None


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int, max_len: int) -> None:
    """Every prompt has 1..max_len-1 tokens, all in [0, vocab)."""
    if not prompts:
        raise InputError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompts[{i}] is empty: give at least one token")
        if len(p) >= max_len:
            raise InputError(f"prompts[{i}] has {len(p)} tokens but the maximum sequence length is {max_len} "
                             "(raise --max-model-len / max_seq_len, or shorten the prompt)")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(f"prompts[{i}] has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def _integer(value: Any, name: str, minimum: int | None = None) -> int:
    n = _as_int(value)
    if n is None or (minimum is not None and n < minimum):
        raise InputError(f"{name}={value!r}: must be an integer" + ("" if minimum is None else f" >= {minimum}"))
    return n


# A torch.Generator takes seeds in [-2**63, 2**64) (a negative one is taken modulo 2**64); others overflow in
# `manual_seed`, so they are refused where the request is built.
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


def check_seed(value: Any, where: str = "seed") -> int:
    """`value` as a seed: an integer in [SEED_MIN, SEED_MAX], else an InputError naming `where` and the range."""
    n = _as_int(value)
    if n is None or not SEED_MIN <= n <= SEED_MAX:
        raise InputError(f"{where}={value!r}: must be an integer in [-2**63, 2**64 - 1] ({SEED_MIN}..{SEED_MAX})")
    return n


def prompt_seeds(seed: Any, n: int) -> tuple[int, ...]:
    """The seeds of n prompts: `seed[i]` (a list or tuple of n), or `seed + i` for one seed, each checked in range
    (`check_seed`; `seed + n - 1` included, named as such)."""
    if isinstance(seed, (list, tuple)):
        return per_prompt(seed, n, "seed", check_seed)
    first = check_seed(seed)
    if first + n - 1 > SEED_MAX:
        raise InputError(f"seed={seed!r}: prompt i samples with seed + i, and seed + {n - 1} is past the largest "
                         f"seed 2**64 - 1 ({SEED_MAX}); give a smaller seed or one seed per prompt")
    return tuple(first + i for i in range(n))


def per_prompt(value: Any, n: int, name: str, check: Callable[[Any, str], Any]) -> tuple:
    """`value` for each of n prompts: one value for all, or a list / tuple of n values; each passed through
    `check(value, where)` (which raises InputError naming `where`)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"{name}: give one value, or one per prompt ({n}), got {len(value)}")
        return tuple(check(v, f"{name}[{i}]") for i, v in enumerate(value))
    one = check(value, name)
    return (one,) * n


def _sampling(value: Any, where: str) -> SamplingParams:
    if not isinstance(value, SamplingParams):
        raise InputError(f"{where}: expected a SamplingParams, got {_type(value)}")
    return value


@dataclass(frozen=True)
class DecodeJob:
    """The checked arguments of one generation call; both loops take the same ones (`make`). Per prompt:
    `max_new_tokens`, `sampling`, `seeds` and, from a `Stops`, `request_stop_ids`; `stop_check` is its check."""

    prompts: list[list[int]]
    max_new_tokens: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    seeds: tuple[int, ...]
    stop_ids: frozenset[int]
    max_len: int
    kv_cache_dtype: str
    prefill_chunk: int
    on_token: TokenCallback | None
    inputs_embeds: list[torch.Tensor | None] | None
    batch_limit: int
    vocab_limit: int
    request_stop_ids: tuple[frozenset[int], ...] | None = None
    stop_check: Callable[[int, int], bool] | None = None

    @classmethod
    def make(cls, model: MiniMaxM3, prompts: Any, *, max_new_tokens: Any = 128, sampling: Any = None,
             seed: Any = 0, stop_ids: Any = (), max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
             prefill_chunk: int | None = None, on_token: TokenCallback | None = None,
             inputs_embeds: list[torch.Tensor | None] | None = None, max_batch_size: int | None = None,
             vocab_limit: int | None = None) -> DecodeJob:
        """Check the arguments of `generate_ids` (documented there); InputError names the bad one. The batch and
        prefill chunk not given (here or in `model.runtime`) are chosen from free memory (`sizing.choose_sizes`)."""
        rt = getattr(model, "runtime", None)
        if not max_seq_len:  # the runtime's (resolved when loaded), or the default capped by the position limit
            max_seq_len = rt.max_seq_len if rt else RuntimeConfig().resolved(
                model.text.max_position_embeddings).max_seq_len
        max_len = _integer(max_seq_len, "max_seq_len", minimum=2)
        kv_dtype = kv_cache_dtype or (rt.kv_cache_dtype if rt else "auto")
        if prefill_chunk is not None:
            prefill_chunk = _integer(prefill_chunk, "prefill_chunk", minimum=1)
        ids = token_prompts(prompts)
        check_prompts(ids, model.text.vocab_size, max_len)
        n = len(ids)
        limit = max_batch_size or (rt.max_batch_size if rt else n)
        if limit is not None:
            limit = _integer(limit, "max_batch_size", minimum=1)
        new = per_prompt(max_new_tokens, n, "max_new_tokens", lambda v, w: _integer(v, w, minimum=0))
        params = per_prompt(SamplingParams() if sampling is None else sampling, n, "sampling", _sampling)
        seeds = prompt_seeds(seed, n)
        if inputs_embeds is not None:
            _check_embeds(inputs_embeds, ids)
        if limit is None or prefill_chunk is None:
            release = getattr(model, "release_captured_steps", None)
            if release is not None:  # an earlier call's captured steps hold its KV cache: count that memory as free
                release()
            cache_len = max(min(max_len, len(p) + m) for p, m in zip(ids, new))
            sizes = choose_sizes(model, cache_len, kv_dtype)
            limit = limit or sizes.max_batch_size
            prefill_chunk = prefill_chunk or sizes.prefill_chunk
        rules = stop_ids if isinstance(stop_ids, Stops) else Stops(stop_ids)
        stop = stop_id_set(rules.ids)
        own = None if rules.per_request is None else per_prompt(
            list(rules.per_request), n, "stop_token_ids", lambda v, w: stop_id_set(v, w))
        vocab = model.text.vocab_size
        limit_ids = vocab if vocab_limit is None else _integer(vocab_limit, "vocab_limit", minimum=1)
        if limit_ids > vocab:
            raise InputError(f"vocab_limit={limit_ids}: the model has {vocab} token ids")
        for where, group in [("stop_ids", stop)] + [(f"stop_token_ids[{i}]", g) for i, g in enumerate(own or ())]:
            outside = sorted(t for t in group if not 0 <= t < limit_ids)
            if outside:  # a stop id the model can never produce would silently never stop
                raise InputError(f"{where} {outside[:5]} are outside the vocabulary [0, {limit_ids})")
        return cls(ids, new, params, seeds, stop, max_len, kv_dtype, prefill_chunk, on_token, inputs_embeds, limit,
                   limit_ids, own, rules.check)

    def choosable(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [..., V] with the ids at and past `vocab_limit` at -inf, so that no sampling rule picks them
        (`logits` itself when every id may be chosen)."""
        if self.vocab_limit >= logits.shape[-1]:
            return logits
        return logits.index_fill(-1, torch.arange(self.vocab_limit, logits.shape[-1], device=logits.device),
                                 float("-inf"))

    def budget(self, i: int) -> int:
        """The most positions request i may reach: its prompt and `max_new_tokens[i]`, within `max_len`."""
        return min(self.max_len, len(self.prompts[i]) + self.max_new_tokens[i])


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


# ----------------------------------------------------------------------------------------------
# stop rules, padding and prefill


def finishes(seq: Sequence_, token: int, job: DecodeJob, i: int) -> str | None:
    """Why request i ends with `token` just appended to `seq.generated`: "stop" (a stop token of the job or of the
    request, or `stop_check` says so), "length" (its `max_new_tokens`, or `max_len` positions), else None. A stop
    comes before the length: the last token a request may take can still end it by a stop."""
    if token in job.stop_ids or (job.request_stop_ids is not None and token in job.request_stop_ids[i]):
        return "stop"
    if job.stop_check is not None and job.stop_check(i, token):
        return "stop"
    if len(seq.prompt) + len(seq.generated) >= job.budget(i):
        return "length"
    return None


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
# continuous batching, and the plain loop's step

FinishCallback = Callable[[int, Sequence_], None]


class Scheduler:
    """Continuous batching of one job's requests over the slots of one KV cache (module docstring), with the plain
    loop's step: one token a slot.

    `running[s]` is the request decoding in slot s (None: free); `waiting` the requests not yet admitted, in order.
    Request i samples with `job.sampling[i]` from its own generator `generators[i]`, seeded with `job.seeds[i]` as it
    is admitted; `on_finish(i, seq)` is called as request i finishes. `run` returns the sequences in request order
    and the stats.

    A subclass with another step (`speculative.SpeculativeScheduler`) keeps `run`, `admit`, `sample`, `emit` and
    `finish`, and replaces `decode` (one step of every slot), and where its slots live: `new_cache` and
    `prompt_forward` (the forward that prefills a run of slots).
    """

    def __init__(self, model: MiniMaxM3, job: DecodeJob, on_finish: FinishCallback | None = None,
                 stats: GenerationStats | None = None):
        self.model, self.job, self.on_finish = model, job, on_finish
        n = len(job.prompts)
        self.seqs = [Sequence_(list(p)) for p in job.prompts]
        self.generators: list[torch.Generator | None] = [None] * n
        self.stats = GenerationStats() if stats is None else stats
        self.stats.prompt_tokens = sum(len(p) for p in job.prompts)
        self.stats.max_batch_size, self.stats.prefill_chunk = job.batch_limit, job.prefill_chunk
        self.waiting = deque(range(n))
        slots = min(job.batch_limit, n)
        rounded = getattr(model, "batch_slots", None)  # a model that compiles a step per batch size rounds it up
        self.running: list[int | None] = [None] * (rounded(slots, job.batch_limit) if rounded else slots)
        self.cache = self.new_cache(len(self.running), max(job.budget(i) for i in range(n)))
        self.start = time.perf_counter()

    def new_cache(self, slots: int, length: int) -> Any:
        """The KV cache of `slots` rows of `length` positions (a fast model may round the length up: its compiled
        steps are specialised on the cache length)."""
        return self.model.new_cache(slots, length, self.job.kv_cache_dtype)

    def run(self) -> tuple[list[Sequence_], GenerationStats]:
        """Admit requests into free slots, step the slots, until every request has finished."""
        while True:
            self.admit()
            if all(i is None for i in self.running):
                return self.seqs, self.stats
            self.step()

    def admit(self) -> None:
        """Fill the free slots with waiting requests: each run of neighbouring free slots takes the next requests
        whose prompts, right-padded to the longest, fit one prefill forward together (`prefill_chunk` tokens; a
        longer prompt goes alone, in chunks); their prompts are prefilled into those slots' rows at once and each
        request's first token sampled from its own row (a request that finishes there frees its slot again)."""
        while self.waiting:
            free = [s for s, i in enumerate(self.running) if i is None]
            if not free:
                return
            group: list[int] = []
            while self.waiting and len(group) < len(free) and free[len(group)] == free[0] + len(group):
                i = self.waiting[0]
                if self.job.max_new_tokens[i] == 0:
                    self.waiting.popleft()
                    self.seqs[i].admitted_seconds = time.perf_counter() - self.start
                    self.finish(i, "length")
                    continue
                longest = max([len(self.job.prompts[r]) for r in group] + [len(self.job.prompts[i])])
                if group and (len(group) + 1) * longest > self.job.prefill_chunk:
                    break
                group.append(self.waiting.popleft())
            if not group:
                continue
            s0 = free[0]
            admitted = time.perf_counter() - self.start
            for s, i in enumerate(group, start=s0):
                self.running[s] = i
                self.seqs[i].admitted_seconds = admitted
                self.generators[i] = torch.Generator(device="cpu").manual_seed(self.job.seeds[i])
            t0 = time.perf_counter()
            logits = self.prefill(s0, group)
            self.stats.prefill_seconds += time.perf_counter() - t0
            for s, token in enumerate(self.sample(group, logits), start=s0):
                self.emit(s, [token])

    def prefill(self, s0: int, requests: list[int]) -> torch.Tensor:
        """The prompts of `requests` through `prompt_forward` into slots s0, s0 + 1, ..., right-padded, in forwards
        of at most `prefill_chunk` tokens; the logits [len(requests), V] of each one's last prompt token.
        (The padding's keys land past a prompt's end, in slots its own decode steps overwrite before reading.)"""
        job = self.job
        embeds = None if job.inputs_embeds is None else [job.inputs_embeds[i] for i in requests]
        ids, emb = pad_prompts(self.model, [job.prompts[i] for i in requests], embeds)
        chunk = max(1, job.prefill_chunk // len(requests))
        return prefill(self.prompt_forward(s0, s0 + len(requests)), ids, [len(job.prompts[i]) for i in requests],
                       emb, chunk)

    def prompt_forward(self, start: int, stop: int
                       ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]:
        """The forward (`prefill`'s) that writes the rows of slots start..stop-1 of the cache."""
        cache = self.cache.rows(start, stop)
        return lambda x, pos, e, index: self.model(x, positions=pos, cache=cache, inputs_embeds=e, logit_index=index)

    def step(self) -> None:
        """One decode step of every slot (`decode`), timed into the stats: the first apart (`warmup_seconds`), the
        others with the tokens they chose."""
        t1, before = time.perf_counter(), self.stats.generated_tokens
        self.decode()
        self.stats.count_step(time.perf_counter() - t1, self.stats.generated_tokens - before)

    def decode(self) -> None:
        """The plain step: one token of every slot (free ones feed a token at position 0 of their own rows, which
        the next request's prefill overwrites); each running request emits one token."""
        device = self.model.device
        tokens = [0 if i is None else self.seqs[i].generated[-1] for i in self.running]
        positions = [0 if i is None else self.committed(i) for i in self.running]
        logits = self.model.step(torch.tensor(tokens, device=device)[:, None],
                                 torch.tensor(positions, device=device)[:, None], self.cache)[:, 0]
        rows = [s for s, i in enumerate(self.running) if i is not None]
        chosen = self.sample([self.running[s] for s in rows], logits[rows])
        for s, token in zip(rows, chosen):
            self.emit(s, [token])

    def row_sampling(self, requests: list[int | None]) -> RowSampling:
        """How each of `requests` samples: its own setting and generator (None: a free slot, greedy, no draw)."""
        return RowSampling(tuple(GREEDY if i is None else self.job.sampling[i] for i in requests),
                           tuple(None if i is None else self.generators[i] for i in requests))

    def sample(self, requests: list[int], logits: torch.Tensor) -> list[int]:
        """One token for each of `requests` from its row of `logits` [n, V], with its own settings and generator,
        among the job's choosable ids."""
        return self.row_sampling(requests).sample(self.job.choosable(logits))[0].tolist()

    def committed(self, i: int) -> int:
        """Positions of request i the model has processed and keeps: its prompt and every generated token but the
        last (the one fed next, at this position)."""
        s = self.seqs[i]
        return len(s.prompt) + max(0, len(s.generated) - 1)

    def emit(self, s: int, tokens: Sequence[int]) -> int:
        """Append `tokens` to the request in slot s until it finishes (`finishes`: what follows is dropped), calling
        `job.on_token` for each one taken; free the slot if it finished. Returns how many were taken."""
        i = self.running[s]
        seq = self.seqs[i]
        for n, token in enumerate(tokens, start=1):
            seq.generated.append(token)
            self.stats.generated_tokens += 1
            if len(seq.generated) == 1:
                seq.first_token_seconds = time.perf_counter() - self.start
                self.stats.first_token_seconds = self.stats.first_token_seconds or seq.first_token_seconds
            if self.job.on_token:
                self.job.on_token(i, token)
            reason = finishes(seq, token, self.job, i)
            if reason is not None:
                self.running[s] = None
                self.finish(i, reason)
                return n
        return len(tokens)

    def finish(self, i: int, reason: str) -> None:
        seq = self.seqs[i]
        seq.finish_reason, seq.finish_seconds = reason, time.perf_counter() - self.start
        self.generators[i] = None
        if self.on_finish:
            self.on_finish(i, seq)


@torch.no_grad()
def generate_ids(model: MiniMaxM3, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 128,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, seed: int | Sequence[int] = 0,
                 stop_ids: Sequence[int] | int = (), max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                 prefill_chunk: int | None = None, on_token: TokenCallback | None = None,
                 inputs_embeds: list[torch.Tensor | None] | None = None, max_batch_size: int | None = None,
                 on_finish: FinishCallback | None = None, vocab_limit: int | None = None
                 ) -> tuple[list[Sequence_], GenerationStats]:
    """Generate for token-id prompts by continuous batching (`Scheduler`). Returns per-prompt sequences (in order)
    and statistics.

    prompts: a list of token-id lists (or a 2-d integer tensor); one prompt is `[ids]`.
    max_new_tokens, sampling, seed: one value for every prompt or one per prompt. sampling: default
    `SamplingParams()` (temperature 1, no top-k / top-p). seed: prompt i's generator is seeded with `seed + i`
    (or `seed[i]`), whatever else shares its batch; every seed in [-2**63, 2**64 - 1] (`check_seed`).
    stop_ids: a token id or a list of them, or a `Stops` (per-request ids too, and a check of each token).
    max_seq_len / kv_cache_dtype / max_batch_size: default `model.runtime`'s
    (max_batch_size: requests decoded together).
    on_token(row, token_id) is called as each token is chosen (for streaming); on_finish(row, sequence) as each
    prompt finishes.
    inputs_embeds: optional per-prompt [len, H] embeddings replacing the token embeddings
    (images); rows without them use the token embeddings.
    vocab_limit: tokens are chosen among ids [0, vocab_limit) only (default: all of the model's; `generate` passes
    the tokenizer's size).
    Bad arguments raise InputError naming the argument.
    """
    job = DecodeJob.make(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                         stop_ids=stop_ids, max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype,
                         prefill_chunk=prefill_chunk, on_token=on_token, inputs_embeds=inputs_embeds,
                         max_batch_size=max_batch_size, vocab_limit=vocab_limit)
    # a fast model may run the same requests with another loop (`fast.overlap.OverlapScheduler`)
    scheduler = getattr(model, "decode_scheduler", Scheduler)
    return scheduler(model, job, on_finish).run()


__all__ = ["SEED_MAX", "SEED_MIN", "DecodeJob", "GenerationStats", "Scheduler", "Sequence_", "Stops",
           "check_prompts", "check_seed", "finishes", "generate_ids", "pad_prompts", "per_prompt", "prefill",
           "prompt_seeds", "stop_id_set", "token_prompts"]
