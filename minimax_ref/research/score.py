"""`minimax-ref score`: per-token log-likelihood of given completions, and drift against a reference.

Traces file (spec `interface.md`): one JSON object per line, either

* `{"prompt": str, "completion": str}`: raw mode encodes the prompt exactly as the tokenizer files
  say (their post-processor decides any BOS) and appends the completion's tokens as they fall in the
  tokenization of the whole text (`raw_trace_ids`: no special tokens between the two); with `--chat` the
  prompt is one user turn rendered with the chat template and the completion is the assistant's reply,
  scored as the model would generate it after the generation prompt: `</mm:think>{completion}[e~[` (the
  template's assistant turn, without the newline that follows the end-of-turn token, which the model never
  generates). With `--chat` a line may also give
  `"messages"` (a conversation) in place of `"prompt"`, its own `"tools"`, `"thinking"` and `"system"`, and
  the completion as an assistant message (`{"content", "reasoning_content", "tool_calls"}`: a reply with its
  reasoning or its tool calls, rendered by the template as in a conversation's history);
* `{"input_ids": [int, ...], "completion_start": int}`: tokens used as given; positions
  `completion_start .. len-1` are the completion.

Optional keys `id` and `meta` are carried through; any other key is an error. Blank lines are
skipped. Every problem is an `InputError` naming the file and line.

Scoring is prefill only: the traces are sorted by length, batched (right padding is exact because
MSA blocks are anchored to absolute positions), and prefilled in chunks of `prefill_chunk` positions
through the KV cache, so memory stays bounded for long traces. Logits are computed only at the
positions that predict a completion token, a few hundred rows at a time. The NLL of completion
token `t` is `-log_softmax(logits[t-1])[ids[t]]` (fp32 logits, summed in float64).

Drift (decided here). For traces i = 1..m with n_i completion tokens and per-trace NLL difference
`d_i = sum_t (nll_model[t] - nll_reference[t])`:

* `drift_1e3 = 1000 * sum_i d_i / sum_i n_i`: the extra NLL per completion token, every token
  weighted equally (a ratio estimator, matching "total NLL difference / completion tokens");
* `drift_stderr_1e3 = 1000 * sqrt(m / (m - 1) * sum_i (d_i - D n_i)^2) / sum_i n_i` with
  `D = sum d_i / sum n_i`: the linearised (delta-method) standard error of that ratio with the
  traces as independent clusters. Tokens within a trace are correlated, so the trace is the unit of
  sampling; this reduces to the usual standard error of the mean when all traces have equal
  length. `null` when there is only one trace.
* `top1_agreement`: fraction of completion positions where both models' argmax (lowest id on ties)
  agree.

The two checkpoints are loaded one after the other: only the per-position NLL and argmax of the
first are kept while the second runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, InputError, NumericsError
from .records import read_jsonl

DEFAULT_BATCH_SIZE = 8
DEFAULT_PREFILL_CHUNK = 2048
# Rows of logits materialised at once: bounds the [rows, vocab] fp32 temporary (about 200 MB at
# the release's vocabulary of 200,064).
LOGIT_ROWS = 256
TRACE_KEYS = {"prompt", "messages", "completion", "tools", "thinking", "system", "input_ids", "completion_start",
              "id", "meta"}
CHAT_ONLY_KEYS = ("messages", "tools", "thinking", "system")


@dataclass(frozen=True)
class ScoreTrace:
    """One trace: token ids and the index of the first completion token (1 <= start < len)."""

    line: int
    input_ids: tuple[int, ...]
    completion_start: int
    id: object = None

    @property
    def completion_tokens(self) -> int:
        return len(self.input_ids) - self.completion_start


@dataclass
class TraceScore:
    """Per completion position of one trace: NLL (float64) and the model's argmax (long)."""

    nll: torch.Tensor
    argmax: torch.Tensor


# ---------------------------------------------------------------------------------------------- traces


def chat_trace_ids(tok, prompt: str | list, completion: str | dict, *, tools: list | None = None,
                   thinking: str = "adaptive", system: str | None = None) -> tuple[list[int], int]:
    """Token ids of a chat-rendered (prompt, assistant completion) pair and the completion start.

    prompt: one user turn, or a list of messages; completion: the reply's text, or an assistant message
    (`content`, optional `reasoning_content`, `tool_calls`). `tools`, `thinking` and `system` render as
    `generate` renders them. The prompt is rendered with the generation prompt (what generation would see)
    and encoded; the completion is the text the full conversation adds after it, up to and including the
    end-of-turn token, encoded separately (as generated tokens would be).
    """
    from ..generation.chat import TURN_END

    user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None and not any(m.get("role") == "system" for m in user):
        user = [{"role": "system", "content": system}, *user]
    reply = {"role": "assistant", "content": completion} if isinstance(completion, str) \
        else {"role": "assistant", **completion}
    prefix = tok.apply_chat_template(user, tools=tools, thinking=thinking, add_generation_prompt=True,
                                     tokenize=False)
    full = tok.apply_chat_template(user + [reply], tools=tools, thinking=thinking, add_generation_prompt=False,
                                   tokenize=False)
    if not full.startswith(prefix):
        raise InputError("the chat template's assistant turn does not extend its generation prompt; "
                         "give the trace as input_ids / completion_start instead")
    reply = full[len(prefix):]
    end = reply.rfind(TURN_END)
    if end >= 0:
        reply = reply[: end + len(TURN_END)]
    prompt_ids = tok.encode(prefix, add_special_tokens=False)
    return prompt_ids + tok.encode(reply, add_special_tokens=False), len(prompt_ids)


def raw_trace_ids(tok, prompt: str, completion: str) -> tuple[list[int], int]:
    """Token ids of a raw-text (prompt, completion) pair and the completion start: the completion's tokens as they
    fall in the tokenization of the whole text prompt + completion (a tokenizer that prefixes a space, or merges
    across the boundary, encodes the completion alone otherwise than in context), after the prompt's tokens with the
    special tokens the tokenizer's post-processor puts before it (a BOS; any it appends after the prompt, such as an
    EOS or [SEP], are left out: they would sit between the prompt and its completion).

    As lm-evaluation-harness does, spaces that end the prompt count as the completion's start; when the whole
    text's tokens do not begin with the prompt's (a merge across the boundary), the completion is encoded alone."""
    stripped = prompt.rstrip(" ")
    if stripped:
        prompt, completion = stripped, prompt[len(stripped):] + completion
    bare = tok.encode(prompt, add_special_tokens=False)
    with_specials = tok.encode(prompt)
    prompt_ids = with_specials
    for k in range(len(with_specials) - len(bare) + 1):  # drop what the post-processor appends
        if with_specials[k:k + len(bare)] == bare:
            prompt_ids = with_specials[:k + len(bare)]
            break
    whole = tok.encode(prompt + completion, add_special_tokens=False)
    tail = whole[len(bare):] if whole[:len(bare)] == bare else tok.encode(completion, add_special_tokens=False)
    return prompt_ids + tail, len(prompt_ids)


def parse_trace(obj: object, tok, *, chat: bool, vocab_size: int | None, max_len: int | None) -> ScoreTrace:
    """Validate one decoded JSON line and turn it into token ids (line number set by the caller)."""
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - TRACE_KEYS)
    if unknown:
        raise InputError(f"unknown keys {unknown} (known: {sorted(TRACE_KEYS)})")
    text_form = "prompt" in obj or "messages" in obj or "completion" in obj
    ids_form = "input_ids" in obj or "completion_start" in obj
    if text_form == ids_form:
        raise InputError("give either 'prompt' (or 'messages') and 'completion', or 'input_ids' and "
                         "'completion_start'")
    chat_only = [k for k in CHAT_ONLY_KEYS if k in obj] + (["a message 'completion'"]
                                                           if isinstance(obj.get("completion"), dict) else [])
    if chat_only and not chat:
        raise InputError(f"{', '.join(chat_only)}: chat traces only (render with the chat template: --chat, "
                         "chat=True)")
    if ids_form and chat_only:
        raise InputError(f"{', '.join(chat_only)}: token-id traces are scored as given (no rendering)")
    if text_form:
        if ("prompt" in obj) == ("messages" in obj):
            raise InputError("give exactly one of 'prompt' (a user turn) or 'messages' (a conversation)")
        prompt, completion = obj.get("prompt", obj.get("messages")), obj.get("completion")
        if "messages" in obj and (not isinstance(prompt, list) or not prompt
                                  or not all(isinstance(m, dict) for m in prompt)):
            raise InputError("'messages' must be a non-empty list of message objects")
        if "prompt" in obj and not isinstance(prompt, str):
            raise InputError("'prompt' must be a string")
        if isinstance(completion, dict):
            bad = sorted(set(completion) - {"content", "reasoning_content", "tool_calls"})
            if bad:
                raise InputError(f"'completion' as a message takes 'content', 'reasoning_content' and "
                                 f"'tool_calls', got {bad}")
            if not any(completion.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                raise InputError("'completion' is empty: nothing to score")
        elif not isinstance(completion, str):
            raise InputError("'completion' must be a string (or, with --chat, an assistant message)")
        elif not completion:
            raise InputError("'completion' is empty: nothing to score")
        if tok is None:
            raise InputError("text traces need the checkpoint's tokenizer")
        if chat:
            tools = obj.get("tools")
            if tools is not None:
                from ..generation.chat import record_tools

                tools = record_tools(tools)
            system = obj.get("system")
            if system is not None and not isinstance(system, str):
                raise InputError(f"'system' must be a string, got {system!r}")
            ids, start = chat_trace_ids(tok, prompt, completion, tools=tools,
                                        thinking=obj.get("thinking", "adaptive"), system=system)
        else:
            ids, start = raw_trace_ids(tok, prompt, completion)
        if start == 0:
            raise InputError("the prompt encodes to no tokens: the first completion token needs context")
        if start == len(ids):
            raise InputError("the completion encodes to no tokens")
    else:
        ids, start = obj.get("input_ids"), obj.get("completion_start")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InputError("'input_ids' must be a list of integers")
        if isinstance(start, bool) or not isinstance(start, int):
            raise InputError(f"'completion_start' must be an integer, got {start!r}")
        if not 1 <= start < len(ids):
            raise InputError(f"'completion_start'={start} must be in [1, {len(ids)}) for {len(ids)} input_ids "
                             "(at least one prompt token and one completion token)")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if max_len is not None and len(ids) > max_len:
        raise InputError(f"the trace has {len(ids)} tokens, more than --max-model-len {max_len}")
    return ScoreTrace(0, tuple(ids), start, obj.get("id"))


def read_traces(path: str | Path, tok=None, *, chat: bool = False, vocab_size: int | None = None,
                max_len: int | None = None, flag: str = "--traces") -> list[ScoreTrace]:
    """Read a traces JSONL file. Raises InputError naming `path:line` for the first bad line (an unreadable file
    names the `flag` that gave it)."""

    def parse(obj: object, n: int) -> ScoreTrace:
        t = parse_trace(obj, tok, chat=chat, vocab_size=vocab_size, max_len=max_len)
        return ScoreTrace(n, t.input_ids, t.completion_start, t.id)

    return read_jsonl(path, parse, flag=flag, what="traces")


# ---------------------------------------------------------------------------------------------- prefill


@dataclass
class PrefillChunk:
    """Hidden states of one prefill chunk of a batch: `hidden` [B, t, H] (residual stream before the
    final norm) at positions `start .. start+t-1`; `rows[b]` is the index into the caller's list;
    `lengths[b]` the real length of row b (positions past it are padding); `trace` the chunk's Trace."""

    rows: list[int]
    start: int
    hidden: torch.Tensor
    lengths: list[int]
    trace: object


@torch.no_grad()
def prefill_chunks(model, seqs: Sequence[Sequence[int]], *, batch_size: int = DEFAULT_BATCH_SIZE,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_cache_dtype: str | None = None,
                   trace: bool = False, interventions=None) -> Iterator[PrefillChunk]:
    """Prefill every sequence through the KV cache, yielding each chunk's hidden states.

    Sequences are sorted longest first and grouped `batch_size` at a time (similar lengths share a
    batch, so padding stays small), right-padded with token 0 and prefilled `prefill_chunk`
    positions at a time. With `trace`, each chunk carries a fresh `model.Trace` (router choices and
    MSA blocks of that chunk only; no hidden states are kept). `interventions` (`Interventions`) edit every
    chunk's forward (`research.intervened.check_for_generation` says which edits a chunked forward takes).
    """
    from ..research.intervened import check_for_generation
    from ..research.trace import Trace

    if interventions is not None:
        check_for_generation(interventions)
        interventions.check(model)
    if batch_size < 1 or prefill_chunk < 1:
        raise InputError(f"batch size {batch_size} and prefill chunk {prefill_chunk} must be >= 1")
    kv = kv_cache_dtype or getattr(getattr(model, "runtime", None), "kv_cache_dtype", "auto")
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    device = model.device
    for b0 in range(0, len(order), batch_size):
        rows = order[b0: b0 + batch_size]
        lengths = [len(seqs[i]) for i in rows]
        T = max(lengths)
        ids = torch.zeros(len(rows), T, dtype=torch.long, device=device)
        for b, i in enumerate(rows):
            ids[b, : lengths[b]] = torch.tensor(list(seqs[i]), dtype=torch.long, device=device)
        cache = model.new_cache(len(rows), T, kv)
        for s0 in range(0, T, prefill_chunk):
            s1 = min(T, s0 + prefill_chunk)
            pos = torch.arange(s0, s1, device=device).expand(len(rows), -1)
            tr = Trace(layers=set(), interventions=interventions) if trace or interventions is not None else None
            hidden = model.hidden(model.embed(ids[:, s0:s1]), pos, cache, tr)
            yield PrefillChunk(rows, s0, hidden, lengths, tr)
        del cache


def check_traces(model, traces: Sequence[ScoreTrace]) -> None:
    """Refuse, with an InputError naming the trace, what cannot be scored on `model`: a completion start outside
    [1, len) (the first completion token needs a prompt token before it, and there must be one), token ids
    outside the vocabulary, a trace longer than the model's `max_seq_len`."""
    V, limit = model.text.vocab_size, model.max_seq_len
    if not traces:
        raise InputError("no traces to score")
    for i, t in enumerate(traces):
        where = f"trace {i}" + (f" (line {t.line})" if t.line else "")
        n = len(t.input_ids)
        if isinstance(t.completion_start, bool) or not isinstance(t.completion_start, int) \
                or not 1 <= t.completion_start < n:
            raise InputError(f"{where}: completion_start={t.completion_start!r} must be in [1, {n}) for {n} "
                             "input_ids (at least one prompt token and one completion token)")
        bad = [x for x in t.input_ids if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < V]
        if bad:
            raise InputError(f"{where}: token ids {bad[:5]} are outside the vocabulary [0, {V})")
        if n > limit:
            raise InputError(f"{where}: {n} tokens, more than the model's max_seq_len {limit}")


@torch.no_grad()
def score_traces(model, traces: Sequence[ScoreTrace], *, batch_size: int = DEFAULT_BATCH_SIZE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_cache_dtype: str | None = None,
                 interventions=None) -> list[TraceScore]:
    """NLL and argmax at every completion position of every trace (same order as `traces`), under `interventions`
    when given (every prefill chunk edited).

    Position t of a trace (t >= completion_start) is predicted by the logits at t-1; the last
    token is never a query, so each trace is prefilled without it. Traces are checked first
    (`check_traces`).
    """
    check_traces(model, traces)
    nll: list[list[torch.Tensor]] = [[] for _ in traces]
    arg: list[list[torch.Tensor]] = [[] for _ in traces]
    seqs = [t.input_ids[:-1] for t in traces]
    for ch in prefill_chunks(model, seqs, batch_size=batch_size, prefill_chunk=prefill_chunk,
                             kv_cache_dtype=kv_cache_dtype, interventions=interventions):
        t_len = ch.hidden.shape[1]
        for b, i in enumerate(ch.rows):
            tr = traces[i]
            # query positions p predict token p + 1; completion targets are completion_start..len-1
            lo = max(ch.start, tr.completion_start - 1)
            hi = min(ch.start + t_len, len(tr.input_ids) - 1)
            if lo >= hi:
                continue
            targets = torch.tensor(tr.input_ids[lo + 1: hi + 1], dtype=torch.long, device=ch.hidden.device)
            h = ch.hidden[b, lo - ch.start: hi - ch.start]
            for r0 in range(0, h.shape[0], LOGIT_ROWS):
                logits = model.logits(h[r0: r0 + LOGIT_ROWS])
                logp = torch.log_softmax(logits, dim=-1)
                tgt = targets[r0: r0 + LOGIT_ROWS]
                nll[i].append(-logp.gather(-1, tgt[:, None])[:, 0].double().cpu())
                arg[i].append(logits.argmax(-1).cpu())
    return [TraceScore(torch.cat(n), torch.cat(a)) for n, a in zip(nll, arg)]


@dataclass
class Scores:
    """What `score` returns: the traces as scored (token ids, completion start), each one's per-token NLL and
    argmax (`TraceScore`, in the order given), and `summary` (`nll_summary`: tokens, total_nll,
    nll_per_token, perplexity)."""

    traces: list[ScoreTrace]
    per_trace: list[TraceScore]
    summary: dict

    def drift(self, reference: Scores) -> dict:
        """`drift_stats` of these scores against `reference`'s (the same pairs scored by another model)."""
        return drift_stats(self.per_trace, reference.per_trace)


def score(model, tok, pairs: Sequence[object], chat: bool = False, trace=None, *,
          batch_size: int = DEFAULT_BATCH_SIZE, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
          interventions=None) -> Scores:
    """Per-token NLL of completions under `model` (`minimax_ref.research.score`, also `mr.score`).

    pairs: each a (prompt, completion) pair of strings, or a dict in the traces-file form (`{"prompt",
        "completion"}` or `{"input_ids", "completion_start"}`, optional "id"); the module docstring says how text
        becomes tokens (raw, or with `chat` the chat template). tok: the model's tokenizer (None when every pair
        is given as ids). Every pair is checked as the CLI checks a traces file: an InputError names the pair.
    trace: a `model.Trace` to record the forward into (`Trace.capture`): the pairs run through the plain forward
        (no KV cache, no chunking), `batch_size` at a time in the given order, each batch right-padded (exact); the
        trace is reset first and holds the merged records of every pair as one batch [B, T] in the given order,
        `trace.mask` marking the real tokens. Interventions on the trace apply. Without a trace, scoring runs the
        chunked, batched, cached prefill of `score_traces` (longest traces first).
    batch_size: traces run together; prefill_chunk: positions per cached prefill step (without a trace).
    interventions: edits of the cached prefill (without a trace; with one, give them on the trace), as generation
        takes them (`research.intervened`).
    """
    if isinstance(pairs, (str, bytes, dict)) or not isinstance(pairs, Sequence):
        raise InputError(f"pairs must be a list of (prompt, completion) pairs or trace dicts, got "
                         f"{type(pairs).__name__}")
    V, limit = model.text.vocab_size, model.max_seq_len
    traces = []
    for i, pair in enumerate(pairs):
        obj = pair
        if isinstance(pair, (tuple, list)):
            if len(pair) != 2:
                raise InputError(f"pairs[{i}]: expected (prompt, completion), got {len(pair)} items")
            obj = {"prompt": pair[0], "completion": pair[1]}
        try:
            t = parse_trace(obj, tok, chat=chat, vocab_size=V, max_len=limit)
        except InputError as e:
            raise InputError(f"pairs[{i}]: {e}") from None
        traces.append(ScoreTrace(0, t.input_ids, t.completion_start, t.id))
    if trace is not None and interventions is not None:
        raise InputError("score: give the interventions on the trace (Trace(interventions=...)), not both")
    if trace is None:
        per = score_traces(model, traces, batch_size=batch_size, prefill_chunk=prefill_chunk,
                           interventions=interventions)
    else:
        per = _score_traced(model, traces, trace, batch_size)
    return Scores(traces, per, nll_summary(per))


@torch.no_grad()
def _score_traced(model, traces: Sequence[ScoreTrace], trace, batch_size: int) -> list[TraceScore]:
    """`score` with a trace: `trace.capture` of the traces, `batch_size` at a time, each batch's NLL and argmax taken
    from its logits as it runs."""
    check_traces(model, traces)
    out: list[TraceScore | None] = [None] * len(traces)

    def on_batch(rows: range, logits: torch.Tensor) -> None:
        for b, i in enumerate(rows):
            t = traces[i]
            n, s = len(t.input_ids), t.completion_start
            targets = torch.tensor(t.input_ids[s:n], dtype=torch.long, device=logits.device)
            at = logits[b, s - 1: n - 1]
            nll = -torch.log_softmax(at, dim=-1).gather(-1, targets[:, None])[:, 0]
            out[i] = TraceScore(nll.double().cpu(), at.argmax(-1).cpu())

    trace.capture(model, [t.input_ids for t in traces], batch_size=batch_size, on_batch=on_batch)
    return out


# ---------------------------------------------------------------------------------------------- statistics


def nll_summary(scores: Sequence[TraceScore]) -> dict:
    """Totals of one model: completion tokens, total NLL (nats), NLL per token and perplexity."""
    tokens = sum(int(s.nll.numel()) for s in scores)
    total = float(sum(float(s.nll.sum()) for s in scores))
    per_token = total / tokens
    return {"tokens": tokens, "total_nll": total, "nll_per_token": per_token,
            "perplexity": math.exp(per_token) if per_token < 700 else None}  # None: beyond float range


def drift_stats(model: Sequence[TraceScore], reference: Sequence[TraceScore]) -> dict:
    """`drift_1e3`, `drift_stderr_1e3` (ratio estimator, traces as clusters; see the module
    docstring), `top1_agreement` and `tokens` of `model` against `reference`."""
    if len(model) != len(reference):
        raise ValueError("model and reference scores cover different traces")
    n = torch.tensor([float(s.nll.numel()) for s in model], dtype=torch.float64)
    for a, b in zip(model, reference):
        if a.nll.shape != b.nll.shape:
            raise ValueError("model and reference scores cover different completion positions")
    d = torch.stack([(a.nll - b.nll).sum() for a, b in zip(model, reference)])
    N = float(n.sum())
    D = float(d.sum()) / N
    m = len(model)
    stderr = None
    if m > 1:
        stderr = 1000.0 * math.sqrt(m / (m - 1) * float(((d - D * n) ** 2).sum())) / N
    agree = sum(int((a.argmax == b.argmax).sum()) for a, b in zip(model, reference))
    return {"drift_1e3": 1000.0 * D, "drift_stderr_1e3": stderr, "top1_agreement": agree / N, "tokens": int(N)}


def per_trace_rows(traces: Sequence[ScoreTrace], model: Sequence[TraceScore],
                   reference: Sequence[TraceScore] | None, per_token: bool) -> list[dict]:
    """One row per trace: line, id, tokens, nll; with a reference also its nll, drift and agreement."""
    rows = []
    for i, tr in enumerate(traces):
        s = model[i]
        row: dict = {"line": tr.line}
        if tr.id is not None:
            row["id"] = tr.id
        row.update({"tokens": int(s.nll.numel()), "nll": float(s.nll.sum())})
        if reference is not None:
            r = reference[i]
            row["reference_nll"] = float(r.nll.sum())
            row["drift_1e3"] = 1000.0 * float((s.nll - r.nll).sum()) / s.nll.numel()
            row["top1_agreement"] = float((s.argmax == r.argmax).double().mean())
        if per_token:
            row["logprobs"] = [-float(x) for x in s.nll]
            row["argmax"] = s.argmax.tolist()
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- CLI


def build_parser(p: argparse.ArgumentParser) -> None:
    """Flags of `minimax-ref score` (the standard model flags apply to both checkpoints)."""
    from ..cli.arg_types import positive_int
    from ..cli.model_args import add_intervention_flags, add_model_flags

    add_model_flags(p)
    add_intervention_flags(p)
    p.add_argument("--traces", type=Path, required=True,
                   help="JSONL: {'prompt', 'completion'} or {'input_ids', 'completion_start'} per line")
    p.add_argument("--reference", type=Path, default=None,
                   help="reference checkpoint: adds drift_1e3, drift_stderr_1e3, top1_agreement (the reference runs "
                        "without --expert-mask / --drop-experts)")
    p.add_argument("--chat", action="store_true",
                   help="render text traces with the chat template (prompt = user turn, completion = reply)")
    p.add_argument("--per-trace", action="store_true", help="add one row per trace ('per_trace')")
    p.add_argument("--per-token", action="store_true",
                   help="with per-trace rows, also every completion token's log-prob and argmax")
    p.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE,
                   help=f"traces prefilled together (default: {DEFAULT_BATCH_SIZE})")
    p.add_argument("--prefill-chunk", type=positive_int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"positions per prefill step through the KV cache (default: {DEFAULT_PREFILL_CHUNK})")


def load_for_args(path: Path, args: argparse.Namespace, role: str = "model"):
    """Load one checkpoint with the standard model flags, offloaded with --offload / --gpu-memory when given.
    `role` ("model", "reference") names the model's own subfolder of --offload-folder: score loads two models, and
    an offload folder holds one."""
    from ..cli.model_args import fast_mode
    from ..weights.loader import load_model, resolve_dtype

    folder = getattr(args, "offload_folder", None)
    return load_model(path, device=args.device, dtype=resolve_dtype(args.dtype, args.device), act_quant=args.act_quant,
                      weights=args.weights, max_seq_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
                      offload=getattr(args, "offload", "none"), gpu_memory=getattr(args, "gpu_memory", None),
                      offload_folder=None if folder is None else Path(folder) / role,
                      fast=fast_mode(getattr(args, "fast", "auto"), args.device))


def refuse_synthetic(args: argparse.Namespace) -> None:
    """The commands that read a checkpoint folder's files beside the weights (tokenizer, shards to copy) refuse the
    --synthetic-* flags (they would otherwise load the default checkpoint in silence)."""
    given = [flag for flag, name in (("--synthetic-weights", "synthetic_weights"),
                                     ("--synthetic-layers", "synthetic_layers"),
                                     ("--synthetic-experts", "synthetic_experts"))
             if getattr(args, name, None) is not None]
    if given:
        raise InputError(f"{', '.join(given)}: `minimax-ref {args.command}` reads a checkpoint folder; write one "
                         "with `minimax-ref synth --preset tiny --out DIR` and give --ckpt-path DIR")


def load_traces_for_args(path: Path, ckpt: Path, args: argparse.Namespace, flag: str = "--traces") -> list[ScoreTrace]:
    """Read a traces file with the checkpoint's tokenizer and vocabulary (before any weights load)."""
    from ..generation.tokenizer import load_tokenizer
    from ..model.config import RuntimeConfig, load_model_config

    cfg = load_model_config(ckpt)
    tok = load_tokenizer(ckpt)
    max_len = RuntimeConfig(max_seq_len=args.max_model_len).resolved(cfg.text.max_position_embeddings,
                                                                     "--max-model-len").max_seq_len
    return read_traces(path, tok, chat=args.chat, vocab_size=cfg.text.vocab_size, max_len=max_len, flag=flag)


def free(model) -> None:
    """Drop a model and give its memory back before the next one loads."""
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    """`minimax-ref score`: one JSON object on stdout."""
    from ..model.config import RuntimeConfig, load_model_config
    from ..weights.embedded import default_checkpoint
    from .intervened import cli_interventions

    refuse_synthetic(args)
    ckpt = args.ckpt_path or default_checkpoint()
    traces = load_traces_for_args(args.traces, ckpt, args)
    cli_interventions(args)  # a bad --expert-mask / --drop-experts is refused before the model loads
    if args.reference is not None:  # everything the reference needs is checked before either model loads
        v_model = load_model_config(ckpt).text.vocab_size
        ref_text = load_model_config(args.reference).text
        if v_model != ref_text.vocab_size:
            raise ConfigError(f"{args.reference}/config.json: vocab_size={ref_text.vocab_size} differs from {ckpt}'s "
                              f"{v_model}; drift needs one tokenizer")
        limit = RuntimeConfig(max_seq_len=args.max_model_len).resolved(ref_text.max_position_embeddings,
                                                                        "--max-model-len").max_seq_len
        long = [i for i, t in enumerate(traces) if len(t.input_ids) > limit]
        if long:
            i = long[0]
            raise InputError(f"--reference {args.reference}: trace {i} (line {traces[i].line}) has "
                             f"{len(traces[i].input_ids)} tokens, more than the reference's max_seq_len {limit} "
                             f"({len(long)} traces are); score traces both models can read")
    kw = {"batch_size": args.batch_size, "prefill_chunk": args.prefill_chunk}
    model = load_for_args(ckpt, args)
    scores = score_traces(model, traces, **kw, interventions=cli_interventions(args, model))
    free(model)
    model = None
    out: dict = {"ckpt_path": str(ckpt), "traces": len(traces), **nll_summary(scores)}
    ref_scores = None
    if args.reference is not None:
        ref = load_for_args(args.reference, args, role="reference")
        ref_scores = score_traces(ref, traces, **kw)
        free(ref)
        ref = None
        rs = nll_summary(ref_scores)
        out.update({"reference": str(args.reference), "reference_total_nll": rs["total_nll"],
                    "reference_nll_per_token": rs["nll_per_token"], **drift_stats(scores, ref_scores),
                    "drift_estimator": "ratio of sums over traces; s.e. by the delta method with traces as "
                                       "clusters"})
    if args.per_trace or args.per_token:
        out["per_trace"] = per_trace_rows(traces, scores, ref_scores, args.per_token)
    bad = nonfinite_fields(out)
    if bad:  # JSON has no NaN / Infinity: writing them would make the output unreadable to strict parsers
        raise NumericsError(f"score: non-finite result(s) in {', '.join(bad[:5])}; the model's log-likelihoods are "
                            "not finite (check the checkpoint with `minimax-ref inspect`)")
    json.dump(out, sys.stdout, ensure_ascii=False, allow_nan=False)
    sys.stdout.write("\n")
    return 0


def nonfinite_fields(obj: object, path: str = "") -> list[str]:
    """Dotted paths (list items as [i]) of the NaN / Inf floats inside a JSON-ready value."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [path or "(value)"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in nonfinite_fields(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in nonfinite_fields(v, f"{path}[{i}]")]
    return []
