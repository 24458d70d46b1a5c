"""Generation: prefill + decode with a KV cache, and sampling.

Sampling contract (`sample`): logits are fp32; temperature 0 is greedy (argmax, ties to the lowest
id); otherwise logits / temperature, then top-k (keep the k largest; 0 = off), then top-p (keep the
smallest set of most likely tokens whose probability reaches top_p, always at least one; 1.0 = off),
then one draw with `torch.multinomial` from the explicit `torch.Generator`. The same seed gives the
same tokens.

Several prompts run together: they are right-padded (blocks are anchored to absolute positions, so
only right padding is exact), prefilled in chunks of at most `prefill_chunk` positions, and decoded
one token per step, each sequence at its own position. A sequence stops at a stop token (from
`generation_config.json`, else the tokenizer's end-of-turn) or after `max_new_tokens`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InputError
from .fast import CACHE_BUCKET
from .model import MiniMaxM3

PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise InputError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p={self.top_p}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"top_k={self.top_k}: must be an integer >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of `logits` [..., V] (fp32) after temperature, top-k and top-p.

    Greedy parameters give a one-hot distribution on the argmax. Used by sampling and by
    speculative verification, so both see the same distribution.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    z = logits / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of `logits` [B, V] -> LongTensor [B]."""
    if params.greedy:
        return logits.argmax(-1)
    probs = filtered_probs(logits, params)
    return torch.multinomial(probs.cpu() if generator is not None and generator.device.type == "cpu"
                             else probs, 1, generator=generator).squeeze(-1).to(logits.device)


@dataclass
class Sequence_:
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "prefill_seconds": round(self.prefill_seconds, 6), "decode_seconds": round(self.decode_seconds, 6),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3)}


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
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return list(fallback)


def _check_prompts(prompts: Sequence[Sequence[int]], vocab: int, max_len: int) -> None:
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


def pad_prompts(model: MiniMaxM3, seqs: Sequence[Sequence_], inputs_embeds: list[torch.Tensor | None] | None
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Right-pad the prompts into ids [B, T] (MSA blocks are anchored to absolute positions, so only
    right padding is exact). Returns (ids, prompt lengths, embeddings [B, T, H] or None), the
    embeddings carrying `inputs_embeds[b]` (images) over the token embeddings where given."""
    device = model.device
    lengths = [len(s.prompt) for s in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device=device)
    for b, s in enumerate(seqs):
        ids[b, : len(s.prompt)] = torch.tensor(s.prompt, device=device)
    embeds = None
    if inputs_embeds is not None and any(e is not None for e in inputs_embeds):
        embeds = model.embed(ids)
        for b, e in enumerate(inputs_embeds):
            if e is not None:
                embeds[b, : e.shape[0]] = e.to(embeds.dtype)
    return ids, lengths, embeds


def prefill(forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor], ids: torch.Tensor,
            lengths: Sequence[int], embeds: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """Run `forward(ids_chunk, positions, embeds_chunk) -> logits` over the padded prompts in chunks of
    `chunk` positions; return each row's logits at its last prompt token, [B, V] fp32."""
    B, T = ids.shape
    last: list[torch.Tensor | None] = [None] * B
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        pos = torch.arange(s0, s1, device=ids.device).expand(B, -1)
        logits = forward(ids[:, s0:s1], pos, None if embeds is None else embeds[:, s0:s1])
        for b in range(B):
            if s0 <= lengths[b] - 1 < s1:
                last[b] = logits[b, lengths[b] - 1 - s0]
    return torch.stack(last)


@torch.no_grad()
def generate_ids(model: MiniMaxM3, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0, stop_ids: Sequence[int] = (),
                 max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, on_token: Callable[[int, int], None] | None = None,
                 inputs_embeds: list[torch.Tensor | None] | None = None) -> tuple[list[Sequence_], GenerationStats]:
    """Generate for a batch of token-id prompts. Returns per-prompt sequences and statistics.

    on_token(row, token_id) is called as each token is chosen (for streaming).
    inputs_embeds: optional per-prompt [len, H] embeddings replacing the token embeddings
    (images); rows without them use the token embeddings.
    """
    rt = getattr(model, "runtime", None)
    max_len = max_seq_len or (rt.max_seq_len if rt else 4096)
    kv_dtype = kv_cache_dtype or (rt.kv_cache_dtype if rt else "auto")
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    _check_prompts(prompts, model.text.vocab_size, max_len)
    limit = rt.max_batch_size if rt else len(prompts)
    if len(prompts) > limit:  # run in groups of at most max_batch_size sequences
        seqs_all: list[Sequence_] = []
        total = GenerationStats()
        for g0 in range(0, len(prompts), limit):
            group_cb = None if on_token is None else (lambda row, tok, g0=g0: on_token(g0 + row, tok))
            seqs_g, st = generate_ids(model, prompts[g0:g0 + limit], max_new_tokens=max_new_tokens, sampling=sampling,
                                      seed=seed + g0, stop_ids=stop_ids, max_seq_len=max_len, kv_cache_dtype=kv_dtype,
                                      prefill_chunk=prefill_chunk, on_token=group_cb,
                                      inputs_embeds=None if inputs_embeds is None else inputs_embeds[g0:g0 + limit])
            seqs_all += seqs_g
            for f in ("prompt_tokens", "generated_tokens", "prefill_seconds", "decode_seconds", "decode_steps"):
                setattr(total, f, getattr(total, f) + getattr(st, f))
        return seqs_all, total
    device = model.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seqs = [Sequence_(list(map(int, p))) for p in prompts]
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    B = len(seqs)
    ids, lengths, embeds = pad_prompts(model, seqs, inputs_embeds)
    T = ids.shape[1]
    budget = min(max_len, T + max_new_tokens)
    if model.fast.compile_layers:  # compiled steps are specialised on the cache length: reuse a few lengths
        budget = min(max_len, -(-budget // CACHE_BUCKET) * CACHE_BUCKET)
    cache = model.new_cache(B, budget, kv_dtype)

    t0 = time.perf_counter()
    last_logits = prefill(lambda x, pos, emb: model(x, positions=pos, cache=cache, inputs_embeds=emb),
                          ids, lengths, embeds, prefill_chunk)
    lengths = torch.tensor(lengths, device=device)
    stats.prefill_seconds = time.perf_counter() - t0

    stop = set(int(i) for i in stop_ids)
    t1 = time.perf_counter()
    active = [True] * B
    for _ in range(max_new_tokens):
        nxt = sample(last_logits, sampling, gen)
        for b, s in enumerate(seqs):
            if not active[b]:
                continue
            tok = int(nxt[b])
            s.generated.append(tok)
            stats.generated_tokens += 1
            if on_token:
                on_token(b, tok)
            if tok in stop:
                s.finish_reason, active[b] = "stop", False
            elif len(s.prompt) + len(s.generated) >= budget or len(s.generated) >= max_new_tokens:
                s.finish_reason, active[b] = "length", False
        if not any(active):
            break
        # finished rows still ride along (static batch); their writes land in their own dead slots
        pos = lengths.clamp(max=budget - 1)[:, None]
        logits = model(nxt[:, None], positions=pos, cache=cache)
        last_logits = logits[:, 0]
        lengths = lengths + torch.tensor(active, device=device, dtype=lengths.dtype)
        stats.decode_steps += 1
    for s in seqs:
        if s.finish_reason is None:
            s.finish_reason = "length"
    stats.decode_seconds = time.perf_counter() - t1
    return seqs, stats


@dataclass
class GenerationResult:
    """One prompt's outcome, as `--output-format json` prints it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    reasoning: str | None
    content: str
    tool_calls: list[dict]
    finish_reason: str
    stats: dict
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids, "text": self.text,
                "reasoning": self.reasoning, "content": self.content, "tool_calls": self.tool_calls,
                "finish_reason": self.finish_reason, "errors": self.errors, "stats": self.stats}


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
    if image_tokens is not None:
        from .multimodal import ImageTokenIds, expand_image_markers, has_image_markers, place_images_first

    token_ids = isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)
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
            raise InputError(f"prompt must be a string or a list of token ids without chat, got "
                             f"{type(prompt).__name__}")
        else:
            ids = tok.encode(prompt)
    # Without images, token ids stay as given and a tokenizer without image tokens has no markers.
    if image_tokens is None or (not image_tokens and (token_ids or tok.special_ids.image is None)):
        return ids
    return expand_image_markers(ids, image_tokens, ImageTokenIds.from_tokenizer(tok), where)


def generate(model: MiniMaxM3, tok, prompts: Sequence, *, max_new_tokens: int = 128, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, chat: bool = False, tools=None,
             thinking: str = "adaptive", system: str | None = None, stop_ids: Sequence[int] | None = None,
             draft=None, num_speculative_tokens: int | None = None,
             on_text: Callable[[int, str], None] | None = None,
             images: Sequence | None = None) -> list[GenerationResult]:
    """Generate for several prompts (strings, token-id lists, or with `chat` message lists).

    Returns one `GenerationResult` per prompt with the reasoning/content split and parsed tool calls
    (spec `chat.md`). `on_text(row, text)` streams decoded text as it becomes complete.
    images: one entry per prompt (None for a prompt without images): a list of image file paths or
    PIL images (a single one alone also works), or preprocessed `(pixel_values, image_grid_thw)`;
    chat messages may carry image parts instead. At most `model.runtime.max_images_per_prompt`
    per prompt. Prompt assembly and the accepted forms: `minimax_ref.multimodal`.
    draft: speculative decoding (`speculative.py`): a loaded `drafter.DSparkDrafter`
    (`drafter.load_drafter`), "dspark" to load the checkpoint's own `dspark/` folder on each call, or a
    drafter folder. num_speculative_tokens: drafts verified per step (default: the drafter's block
    size). Greedy output is identical to `draft=None`; sampled output has the same distribution.
    The stats then include `mean_accepted_length` and `acceptance_rate_per_position`.
    """
    from .chat import parse_output
    from .errors import ConfigError
    from .multimodal import embed_with_images, load_prompt_images
    from .vision import tokens_per_image

    drafter = None
    if draft is not None:
        from .drafter import resolve_drafter

        drafter = resolve_drafter(model, draft)
    elif num_speculative_tokens is not None:
        raise InputError("num_speculative_tokens needs a drafter (draft=...)")
    sampling = SamplingParams(temperature, top_p, top_k)
    if images is not None and (isinstance(images, (str, bytes)) or len(images) != len(prompts)):
        n = 1 if isinstance(images, (str, bytes)) else len(images)
        raise InputError(f"images: give one entry per prompt (a list of images, or None), got {n} "
                         f"entries for {len(prompts)} prompts")
    ids: list[list[int]] = []
    embeds: list[torch.Tensor | None] = []
    for i, p in enumerate(prompts):
        where = f"prompt {i}"
        pixels = load_prompt_images(model, None if images is None else images[i], p, chat=chat, where=where)
        counts = [] if pixels is None else tokens_per_image(pixels[1], model.config.vision.spatial_merge_size)
        if pixels is not None and tok.special_ids.image != model.config.image_token_id:
            raise ConfigError(f"the tokenizer's image token id {tok.special_ids.image} differs from "
                              f"config.json image_token_index={model.config.image_token_id}")
        ids.append(encode_prompt(tok, p, chat=chat, tools=tools, thinking=thinking, system=system,
                                 image_tokens=counts, where=where))
        # The vision tower runs once per prompt, here; decoding only ever sees text embeddings.
        embeds.append(None if pixels is None else embed_with_images(model, ids[-1], *pixels))
    if stop_ids is None:
        stop_ids = read_stop_ids(getattr(model, "ckpt_path", None), tok.eos_token_ids)
    decoders = [tok.stream_decoder() for _ in ids]
    stop_set = set(stop_ids)

    def on_token(row: int, token: int) -> None:
        if token in stop_set:  # the end-of-turn token ends the text; it is not part of it
            return
        piece = decoders[row].push(token)
        if piece and on_text:
            on_text(row, piece)

    run_kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_ids=stop_ids,
                  on_token=on_token if on_text else None,
                  inputs_embeds=embeds if any(e is not None for e in embeds) else None)
    if drafter is None:
        seqs, stats = generate_ids(model, ids, **run_kw)
    else:
        from .speculative import speculative_generate_ids

        seqs, stats = speculative_generate_ids(model, drafter, ids, num_speculative_tokens=num_speculative_tokens,
                                               **run_kw)
    results = []
    think_start = tok.special_ids.think_start
    for prompt_ids, s, dec in zip(ids, seqs, decoders, strict=True):
        if on_text:
            rest = dec.finish()
            if rest:
                on_text(seqs.index(s), rest)
        body = [t for t in s.generated if t not in stop_set]
        text = tok.decode(body)
        # a prompt that ends inside <mm:think> (thinking enabled) generates reasoning first
        started = think_start is not None and len(prompt_ids) > 0 and prompt_ids[-1] == think_start
        parsed = parse_output(text, tools, reasoning_started=started)
        results.append(GenerationResult(prompt_ids, s.generated, text, parsed["reasoning"], parsed["content"],
                                        parsed["tool_calls"], s.finish_reason, stats.as_dict(),
                                        parsed["errors"]))
    return results
