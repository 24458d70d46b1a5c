"""Generation front end: text, chat and image prompts in; decoded, parsed results out.

`generate(model, tok, prompts, ...)` encodes each prompt (`encode_prompt`: token ids as given, raw
text, or a chat with the chat template), embeds its images once (`multimodal.py`), runs the plain
loop (`decoding.generate_ids`) or, given a drafter, the speculative one (`speculative.py`), then
decodes each output and splits it into reasoning, content and tool calls (`chat.parse_output`).
The layers below: `sampling.py` (the sampling distribution and seeded draws), `decoding.py` (checked
arguments, the continuous-batching scheduler both loops run on, the plain loop), `drafter.py` and `speculative.py`.

Only ids the tokenizer has are generated: a checkpoint's `vocab_size` may be padded past its tokenizer, and those
padding ids have no text (`decoding.DecodeJob.vocab_limit`).

Stop tokens come from `generation_config.json` (`eos_token_id`), else the tokenizer's end-of-turn, plus a request's
own `stop_token_ids`; they end a sequence and are not part of its text. A request's stop strings (`stop`) end it once
its decoded text holds one: its text ends before the first of them (finish_reason "stop"), and streamed text holds
back what could still be the start of one until it is resolved (`StopText`).

Defaults (one set, which the CLI shows and uses too): `chat.DEFAULT_MAX_NEW_TOKENS` tokens per reply (room for
the reasoning of a thinking turn before its answer) and MiniMax's recommended sampling (`chat.RECOMMENDED_SAMPLING`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, InputError
from ..model.vision import tokens_per_image
from ..research.intervened import intervened
from .chat import DEFAULT_MAX_NEW_TOKENS, RECOMMENDED_SAMPLING, parse_output
from .decoding import GenerationStats, Sequence_, Stops, generate_ids, per_prompt, prompt_seeds, stop_id_set
from .drafter import resolve_drafter
from .multimodal import (
    ImageTokenIds,
    embed_with_images,
    expand_image_markers,
    has_image_markers,
    load_prompt_images,
    place_images_first,
)
from .sampling import SamplingParams, filtered_probs, sample
from .speculative import speculative_generate_ids

if TYPE_CHECKING:
    from ..model.decoder import MiniMaxM3
    from ..research.trace import Interventions



def _type(x: object) -> str:
    return type(x).__name__


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_stop_ids(ckpt_dir: str | Path | None, fallback: Sequence[int] = ()) -> list[int]:
    """Stop token ids from `generation_config.json` (`eos_token_id`, int or list), else `fallback`."""
    if ckpt_dir is not None:
        p = Path(ckpt_dir) / "generation_config.json"
        if p.is_file():
            try:
                eos = json.loads(p.read_text()).get("eos_token_id")
            except json.JSONDecodeError as e:
                raise InputError(f"{p}: not valid JSON ({e})") from None
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(_is_int(e) for e in ids):
                    raise ConfigError(f"{p}: eos_token_id={eos!r}: must be a token id or a list of token ids")
                return list(ids)
    return list(fallback)


@dataclass
class GenerationResult:
    """One prompt's outcome, as `--output-format json` prints it. `text`: the reply as streamed
    (`Tokenizer.decode_streamed` of the tokens before a stop token; with a stop string, the text before it).
    `request`: its own figures: prompt and generated tokens; `admitted_seconds`, when it took a batch slot (its
    prefill began), counted from the start of the call (the time it waited in the queue);
    `time_to_first_token_seconds`, from its admission to its first token (its prefill and first draw); `seconds`,
    from the start of the call to its end. `stats`: the whole call's (empty in a result handed to `on_result` before
    the call ends)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    reasoning: str | None
    content: str
    tool_calls: list[dict]
    finish_reason: str
    stats: dict
    errors: list[str] = field(default_factory=list)
    request: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids, "text": self.text,
                "reasoning": self.reasoning, "content": self.content, "tool_calls": self.tool_calls,
                "finish_reason": self.finish_reason, "errors": self.errors, "request": self.request,
                "stats": self.stats}


def encode_prompt(tok, prompt, *, chat: bool = False, tools=None, thinking: str = "adaptive",
                  system: str | None = None, image_tokens: Sequence[int] | None = None,
                  where: str = "prompt") -> list[int]:
    """Token ids of one prompt: a list of ids (used as is), a raw string (encoded exactly as the
    tokenizer files say), or with `chat` a string (one user turn) or a list of messages.

    image_tokens: when given, the language-model tokens of each of the prompt's images, in order
    (`vision.tokens_per_image`; [] for none). The prompt must then hold one image marker per image,
    or none, and then the markers are placed before its text (with `chat`, at the start of the last
    user turn); each marker is expanded to `<start of image>` + N x `<image>` + `<end of image>`
    (`multimodal.expand_image_markers`, which also accepts token ids already expanded). A token-id
    prompt without images is used as is. None (the default) leaves image tokens as they are.
    Raises InputError naming `where` when markers and images do not match.
    """
    token_ids = isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt)
    if chat and isinstance(prompt, (list, tuple)) and not token_ids:
        bad = next((i for i, m in enumerate(prompt) if not isinstance(m, Mapping)), None)
        if bad is not None:
            raise InputError(f"{where}: a chat prompt is a string, token ids or a list of messages (dicts); "
                             f"item {bad} is {_type(prompt[bad])}")
    if token_ids:
        ids = list(prompt)
    else:
        if image_tokens and isinstance(prompt, (str, list, tuple)) and not has_image_markers(prompt):
            prompt = place_images_first(prompt, len(image_tokens))
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if system is not None and not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": system}, *messages]
            ids = tok.apply_chat_template(messages, tools=tools, thinking=thinking,
                                          add_generation_prompt=True)
        elif not isinstance(prompt, str):
            raise InputError(f"{where} must be a string or a list of token ids (integers) without chat, got "
                             f"{_type(prompt)}" + (" of messages: add chat=True" if isinstance(prompt, (list, tuple))
                                                   and any(isinstance(m, Mapping) for m in prompt) else ""))
        else:
            ids = tok.encode(prompt)
    # Without images, token ids stay as given and a tokenizer without image tokens has no markers.
    if image_tokens is None or (not image_tokens and (token_ids or tok.special_ids.image is None)):
        return ids
    return expand_image_markers(ids, image_tokens, ImageTokenIds.from_tokenizer(tok), where)


def text_prompts(prompts: Any, chat: bool) -> list[Any]:
    """`generate`'s `prompts` as a list: a string is one prompt; otherwise a list or tuple of prompts,
    each a string, a list of token ids, or (with `chat`) a list of messages. One flat list of token ids
    or of messages, and anything else, is an InputError saying how to pass it."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise InputError("prompts: got bytes; pass text as str (decode it first)")
    if not isinstance(prompts, (list, tuple)):
        raise InputError(f"prompts: expected a string or a list of prompts, got {_type(prompts)}")
    if prompts and all(_is_int(p) for p in prompts):
        raise InputError("prompts: got one flat list of token ids; pass a list of prompts: [ids]")
    if prompts and all(isinstance(p, Mapping) for p in prompts):
        raise InputError("prompts: got one flat list of chat messages; pass a list of conversations: [messages]"
                         + ("" if chat else " (with chat=True)"))
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, list, tuple)):
            what = "a string, a list of token ids" + (" or a list of messages" if chat else "")
            raise InputError(f"prompts[{i}]: expected {what}, got {_type(p)}")
    return list(prompts)


def per_prompt_chat(tools: Any, thinking: Any, system: Any, n: int) -> tuple[list, list, list]:
    """`generate`'s chat settings for each of n prompts: tools (None, one list of tool schemas for every prompt, or
    a list of n entries each a list of schemas or None), thinking and system (one value, or a list of n)."""
    per_row = isinstance(tools, (list, tuple)) and len(tools) > 0 and all(
        t is None or isinstance(t, (list, tuple)) for t in tools)
    if per_row and len(tools) != n:
        raise InputError(f"tools: a list of per-prompt tool lists needs one entry per prompt ({n}), got {len(tools)}; "
                         "for the same tools everywhere give one list of schemas")
    rows = [list(tools) if per_row else [tools] * n]
    for value, name in ((thinking, "thinking"), (system, "system")):
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise InputError(f"{name}: give one value, or one per prompt ({n}), got {len(value)}")
            rows.append(list(value))
        else:
            rows.append([value] * n)
    return rows[0], rows[1], rows[2]


def stop_strings(value: Any, where: str = "stop") -> tuple[str, ...]:
    """One prompt's stop strings: None (none), a string, or a list of strings; each a non-empty str."""
    if value is None:
        return ()
    if isinstance(value, str):
        if not value:
            raise InputError(f"{where}: a stop string must not be empty")
        return (value,)
    if not isinstance(value, (list, tuple)):
        raise InputError(f"{where}: expected a string or a list of strings, got {_type(value)}")
    for j, s in enumerate(value):
        if not isinstance(s, str):
            raise InputError(f"{where}[{j}]={s!r}: a stop string must be a string, got {_type(s)}")
        if not s:
            raise InputError(f"{where}[{j}]: a stop string must not be empty")
    return tuple(value)


def per_prompt_stops(stop: Any, stop_token_ids: Any, n: int) -> tuple[list[tuple[str, ...]], list[frozenset[int]]]:
    """`generate`'s `stop` and `stop_token_ids` for each of n prompts. stop: None, a string or a list of strings for
    every prompt, or a list of n entries (each None, a string or a list of strings) one per prompt.
    stop_token_ids: None, an id or a list of ids for every prompt, or a list of n entries (each None or a list of
    ids) one per prompt. A list whose entries are all None or lists is the per-prompt form."""
    def per_row(value: Any) -> bool:
        return isinstance(value, (list, tuple)) and len(value) > 0 and all(
            e is None or isinstance(e, (list, tuple, set, frozenset)) for e in value)

    for value, name in ((stop, "stop"), (stop_token_ids, "stop_token_ids")):
        if per_row(value) and len(value) != n:
            raise InputError(f"{name}: a list of per-prompt entries needs one per prompt ({n}), got {len(value)}; "
                             "for the same setting everywhere give one string / id or one flat list")
    strings = ([stop_strings(e, f"stop[{i}]") for i, e in enumerate(stop)] if per_row(stop)
               else [stop_strings(stop, "stop")] * n)
    ids = ([stop_id_set(e, f"stop_token_ids[{i}]") for i, e in enumerate(stop_token_ids)] if per_row(stop_token_ids)
           else [stop_id_set(stop_token_ids, "stop_token_ids")] * n)
    return strings, ids


class StopText:
    """One request's text as it is decoded (`push` each token that is not a stop token), watched for its stop
    strings. `push` returns the text now certain: up to the first stop string once one appears (then `end` is where
    it begins), else all but the longest tail that could still begin a stop string, which is held back until a later
    token resolves it (so a stream never shows part of a stop string). `finish` returns what is left."""

    def __init__(self, decoder: Any, stops: Sequence[str]):
        self.decoder, self.stops = decoder, tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # every character decoded so far
        self.sent = 0  # characters handed out by push / finish
        self.end: int | None = None

    def push(self, token: int) -> str:
        piece = self.decoder.push(token)
        if not piece or self.end is not None:
            return ""
        # a match not found before ends in the new piece: it starts at most longest - 1 characters before it
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        hits = [p for p in (self.text.find(s, start) for s in self.stops) if p >= 0]
        if hits:
            self.end = min(hits)
            return self._release(self.end)
        return self._release(len(self.text) - self._open_tail())

    def _open_tail(self) -> int:
        """The length of the longest end of the text that is a proper prefix of a stop string."""
        for n in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out

    def finish(self) -> str:
        if self.end is not None:
            return ""
        self.text += self.decoder.finish()
        return self._release(len(self.text))


def _check_images(images: Any, n_prompts: int) -> None:
    """`images` is None or one entry per prompt (a list or tuple); the entries are checked where loaded."""
    if images is None:
        return
    if not isinstance(images, (list, tuple)):
        raise InputError(f"images: give a list with one entry per prompt (each a list of images, or None), "
                         f"got {_type(images)}; for one prompt with one image: images=[[image]]")
    bare = next((i for i, e in enumerate(images) if isinstance(e, torch.Tensor)), None)
    if bare is not None:
        raise InputError(f"images[{bare}] is a tensor; preprocessed images of a prompt are one "
                         "(pixel_values, image_grid_thw) pair: images=[(pixel_values, image_grid_thw)]")
    if len(images) != n_prompts:
        raise InputError(f"images: give one entry per prompt (a list of images, or None), got {len(images)} "
                         f"entries for {n_prompts} prompts; several images of one prompt go in one entry: "
                         "images=[[a, b]]")


def generate(model: MiniMaxM3, tok, prompts: str | Sequence, *,
             max_new_tokens: int | Sequence[int] = DEFAULT_MAX_NEW_TOKENS,
             temperature: float | Sequence[float] = RECOMMENDED_SAMPLING["temperature"],
             top_p: float | Sequence[float] = RECOMMENDED_SAMPLING["top_p"],
             top_k: int | Sequence[int] = RECOMMENDED_SAMPLING["top_k"], seed: int | Sequence[int] = 0,
             chat: bool = False, tools=None, thinking: str = "adaptive", system: str | None = None,
             stop_ids: Sequence[int] | int | None = None, stop: str | Sequence | None = None,
             stop_token_ids: int | Sequence | None = None, draft=None, num_speculative_tokens: int | None = None,
             on_text: Callable[[int, str], None] | None = None, images: Sequence | None = None,
             max_batch_size: int | None = None, prefill_chunk: int | None = None,
             on_result: Callable[[int, GenerationResult], None] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             interventions: Interventions | None = None) -> list[GenerationResult]:
    """Generate for several prompts: a list of strings, token-id lists, or with `chat` message lists.
    A single string is one prompt (the result is then a one-element list).

    Returns one `GenerationResult` per prompt, in order, with the reasoning/content split and parsed
    tool calls (spec `chat.md`). `on_text(row, text)` streams decoded text as it becomes complete;
    `on_result(row, result)` hands over each prompt's result as it finishes; `on_token(row, token_id)` each token
    as it is chosen (progress counters).
    max_new_tokens, temperature, top_p, top_k, seed: one value for every prompt, or a list of one per prompt
    (defaults: the module docstring's). Prompt i samples from its own generator seeded with `seed + i` (or
    `seed[i]`), so its tokens do not depend on the other prompts of the call; every seed (seed + i too) is an integer
    in [-2**63, 2**64 - 1], what a torch.Generator takes. A positive temperature is a normal float32 (about 1.2e-38
    to 3.4e38, `sampling.SamplingParams`); 0 is greedy.
    tools, thinking, system (chat): one setting for every prompt, or one per prompt (`per_prompt_chat`: per prompt,
    tools is a list whose entries are each a list of tool schemas or None).
    interventions: edits applied to every forward of the generation (`research.intervened`: expert masks and
    scales, residual edits given as functions; prefill and decode steps alike, so the KV cache holds the edited
    model's keys); tensor-valued edits are refused.
    max_batch_size: prompts decoded together (continuous batching, `decoding.Scheduler`); prefill_chunk: prompt
    tokens per prefill forward. Defaults: `model.runtime.max_batch_size` if set, else both chosen from the memory
    left (`sizing.choose_sizes`); the stats name the sizes used.
    stop_ids: a token id or a list of them (default: `generation_config.json`, else the tokenizer's
    end-of-turn ids). stop_token_ids: more stop ids, added to those: an id or a list for every prompt, or a list of
    one list (or None) per prompt.
    stop: stop strings: a string or a list of strings for every prompt, or a list of one entry (None, a string or a
    list of strings) per prompt; each a non-empty string. A prompt ends once its decoded text holds one: its `text`
    (and what `on_text` streams: a tail that could begin one is held back until resolved) ends before the first,
    `token_ids` keep the tokens generated up to that point, and finish_reason is "stop". In continuous batching it
    frees its slot for the next waiting prompt; its tokens are those it gets alone.
    images: one entry per prompt (None for a prompt without images): a list of image file paths or
    PIL images (a single one alone also works), or preprocessed `(pixel_values, image_grid_thw)`;
    chat messages may carry image parts instead. At most `model.runtime.max_images_per_prompt`
    per prompt. Prompt assembly and the accepted forms: `minimax_ref.generation.multimodal`.
    draft: speculative decoding (`speculative.py`): a loaded `drafter.DSparkDrafter`
    (`drafter.load_drafter`), "dspark" to load the checkpoint's own `dspark/` folder on each call, or a
    drafter folder. num_speculative_tokens: drafts verified per step (default: the drafter's block
    size). Greedy output is identical to `draft=None`; sampled output has the same distribution. Requests are
    batched continuously and sample with their own settings and seeds, as with `draft=None`.
    The stats then include `mean_accepted_length` and `acceptance_rate_per_position`.
    Arguments of the wrong type or value raise InputError naming the argument.
    """
    prompts = text_prompts(prompts, chat)
    prompt_seeds(seed, len(prompts))  # a bad seed is refused before any prompt is encoded
    row_stops, row_stop_ids = per_prompt_stops(stop, stop_token_ids, len(prompts))
    _check_images(images, len(prompts))
    row_tools, row_thinking, row_system = per_prompt_chat(tools, thinking, system, len(prompts))
    run_model = intervened(model, interventions)
    if draft is None and num_speculative_tokens is not None:
        raise InputError("num_speculative_tokens needs a drafter (draft=...)")
    drafter = None if draft is None else resolve_drafter(model, draft)
    n = len(prompts)
    settings = zip(*(per_prompt(v, n, name, lambda x, where: x)
                     for v, name in ((temperature, "temperature"), (top_p, "top_p"), (top_k, "top_k"))))
    sampling = [SamplingParams(*s) for s in settings]
    end_ids = stop_id_set(read_stop_ids(getattr(model, "ckpt_path", None), tok.eos_token_ids)
                          if stop_ids is None else stop_ids)
    ids: list[list[int]] = []
    embeds: list[torch.Tensor | None] = []
    vocab = model.text.vocab_size
    for i, p in enumerate(prompts):
        where = f"prompts[{i}]"  # the Python list index (the CLI numbers --prompt from 1)
        pixels = load_prompt_images(model, None if images is None else images[i], p, chat=chat, where=where)
        counts = [] if pixels is None else tokens_per_image(pixels[1], model.config.vision.spatial_merge_size)
        if pixels is not None and tok.special_ids.image != model.config.image_token_id:
            raise ConfigError(f"the tokenizer's image token id {tok.special_ids.image} differs from "
                              f"config.json image_token_index={model.config.image_token_id}")
        ids.append(encode_prompt(tok, p, chat=chat, tools=row_tools[i], thinking=row_thinking[i],
                                 system=row_system[i], image_tokens=counts, where=where))
        if tok.vocab_size > vocab and any(t >= vocab for t in ids[-1]):
            raise ConfigError(f"{where}: the tokenizer ({tok.path}, {tok.vocab_size} ids) encodes it with ids past "
                              f"the model's vocab_size {vocab} ({sorted({t for t in ids[-1] if t >= vocab})[:5]}): "
                              "the tokenizer is not this model's")
        # The vision tower runs once per prompt, here; decoding only ever sees text embeddings.
        embeds.append(None if pixels is None else embed_with_images(model, ids[-1], *pixels))
    watched = [StopText(tok.stream_decoder(), row_stops[r]) for r in range(n)]
    think_start = tok.special_ids.think_start
    results: list[GenerationResult | None] = [None] * n

    def watch(row: int, token: int) -> bool:
        """Each token that no stop id ended (stop tokens are not text): decoded, streamed, and True at a stop
        string (`decoding.Stops.check`)."""
        piece = watched[row].push(token)
        if piece and on_text:
            on_text(row, piece)
        return watched[row].end is not None

    def on_finish(row: int, s: Sequence_) -> None:
        w = watched[row]
        if on_text:
            rest = w.finish()
            if rest:
                on_text(row, rest)
        if w.end is not None:
            text = w.text[:w.end]  # what on_text streamed: the text before the stop string
        else:
            body = [t for t in s.generated if t not in end_ids and t not in row_stop_ids[row]]
            text = tok.decode_streamed(body)  # what on_text streamed
        # a prompt that ends inside <mm:think> (thinking enabled) generates reasoning first
        started = think_start is not None and len(ids[row]) > 0 and ids[row][-1] == think_start
        parsed = parse_output(text, row_tools[row], reasoning_started=started)
        admitted = s.admitted_seconds
        request = {"prompt_tokens": len(s.prompt), "generated_tokens": len(s.generated),
                   "admitted_seconds": None if admitted is None else round(admitted, 6),
                   "time_to_first_token_seconds": None if s.first_token_seconds is None or admitted is None
                   else round(s.first_token_seconds - admitted, 6),
                   "seconds": None if s.finish_seconds is None else round(s.finish_seconds, 6)}
        results[row] = GenerationResult(ids[row], s.generated, text, parsed["reasoning"], parsed["content"],
                                        parsed["tool_calls"], s.finish_reason, {}, parsed["errors"], request)
        if on_result:
            on_result(row, results[row])

    own_ids = row_stop_ids if any(row_stop_ids) else None
    check = watch if on_text or any(row_stops) else None
    run_kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                  stop_ids=Stops(end_ids, own_ids, check) if own_ids or check else end_ids,
                                  on_token=on_token,
                                  prefill_chunk=prefill_chunk,
                                  inputs_embeds=embeds if any(e is not None for e in embeds) else None,
                                  max_batch_size=max_batch_size, on_finish=on_finish,
                                  vocab_limit=min(tok.vocab_size, vocab))
    if drafter is None:
        _, stats = generate_ids(run_model, ids, **run_kw)
    else:
        _, stats = speculative_generate_ids(run_model, drafter, ids, num_speculative_tokens=num_speculative_tokens,
                                            **run_kw)
    for r in results:
        r.stats = stats.as_dict()
    return results


# Re-exported for the callers that import them from here: the sampling layer and the plain loop.
__all__ = ["DEFAULT_MAX_NEW_TOKENS", "GenerationResult", "GenerationStats", "SamplingParams", "Sequence_", "StopText",
           "encode_prompt", "filtered_probs", "generate", "generate_ids", "per_prompt_stops", "read_stop_ids", "sample",
           "stop_strings", "text_prompts"]
