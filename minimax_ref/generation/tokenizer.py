"""Tokenizer of a checkpoint folder and streaming detokenisation.

`load_tokenizer(path)` reads `tokenizer.json` with the `tokenizers` library (or, when a folder ships
only `tokenizer.model`, sentencepiece), plus `tokenizer_config.json`, `generation_config.json`,
`chat_template.jinja` and `dspark/config.json` when present. Special-token ids are looked up by their
texts (spec `chat.md`) in those files; no id is written in this module.

The project's small test tokenizer, which synthetic checkpoints ship, is trained and written by
`weights.synth_tokenizer`; this module only reads tokenizer files.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, InputError
from . import chat

#: Special tokens by attribute name, in the order they take the top ids in the test tokenizer
#: (`weights.synth_tokenizer`; the release's relative order). `<tool_call>`/`</tool_call>` are
#: ordinary text, not special tokens.
SPECIAL_TOKEN_TEXTS: dict[str, str] = {
    "turn_start": chat.TURN_START,
    "turn_end": chat.TURN_END,
    "image": chat.IMAGE,
    "video": chat.VIDEO,
    "image_start": chat.IMAGE_START,
    "image_end": chat.IMAGE_END,
    "bod": chat.BOD,
    "dspark_noise": chat.DSPARK_NOISE,
    "think_start": chat.THINK_START,
    "think_end": chat.THINK_END,
    "namespace": chat.NS,
}


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens (None where the tokenizer lacks the token)."""

    bod: int | None = None
    turn_start: int | None = None
    turn_end: int | None = None
    image: int | None = None
    video: int | None = None
    image_start: int | None = None
    image_end: int | None = None
    think_start: int | None = None
    think_end: int | None = None
    namespace: int | None = None
    dspark_noise: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------
class _TokenizersBackend:
    """tokenizer.json, plus the entries of tokenizer_config.json's `added_tokens_decoder` it lacks (added at their
    ids, as transformers does: they must continue its ids in order)."""

    def __init__(self, path: Path, config: Mapping[str, Any], config_path: Path):
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exception subclasses for bad files
            raise CheckpointError(f"{path}: not a valid tokenizers file ({e})") from None
        decoder = config.get("added_tokens_decoder") or {}
        entries = sorted((int(k), e) for k, e in decoder.items()
                         if isinstance(e, Mapping) and isinstance(e.get("content"), str) and str(k).isdigit())
        for tid, entry in entries:
            text, have = entry["content"], self.tok.token_to_id(entry["content"])
            if have is not None:
                if have != tid:
                    raise CheckpointError(f"{config_path}: added_tokens_decoder gives {text!r} id {tid}, {path.name} "
                                          f"has it at {have}: the files belong to different tokenizers")
                continue
            if tid != self.vocab_size:
                raise CheckpointError(f"{config_path}: added_tokens_decoder[{tid}] {text!r} is not in {path.name}, "
                                      f"whose next free id is {self.vocab_size}: an added token must continue the ids "
                                      "in order (the files belong to different tokenizers?)")
            special = bool(entry.get("special", False))
            token = AddedToken(text, special=special, normalized=bool(entry.get("normalized", not special)),
                               lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                               single_word=bool(entry.get("single_word", False)))
            (self.tok.add_special_tokens if special else self.tok.add_tokens)([token])
        # A special token that sits in the plain vocabulary would be split by BPE when it appears in
        # rendered text; registering it as an added token keeps its id and makes it atomic.
        for text in SPECIAL_TOKEN_TEXTS.values():
            tid = self.tok.token_to_id(text)
            if tid is not None and self.tok.encode(text, add_special_tokens=False).ids != [tid]:
                self.tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def id_to_token(self, tid: int) -> str | None:
        return self.tok.id_to_token(tid)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _SentencePieceBackend:
    """sentencepiece model plus the added tokens of tokenizer_config.json (split out before encoding)."""

    def __init__(self, path: Path, config: Mapping[str, Any]):
        try:
            import sentencepiece as spm
        except ImportError as e:  # pragma: no cover
            raise CheckpointError(f"{path}: reading tokenizer.model needs sentencepiece: "
                                  "pip install 'minimax-ref[sentencepiece]'") from e
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: not a valid sentencepiece model ({e})") from None
        self.base = self.sp.get_piece_size()
        self.added: dict[str, int] = {}
        self.special_ids: set[int] = set()
        decoder = config.get("added_tokens_decoder") or {}
        for key, entry in decoder.items():
            if isinstance(entry, Mapping) and isinstance(entry.get("content"), str) and str(key).isdigit():
                self.added[entry["content"]] = int(key)
                if entry.get("special", True):
                    self.special_ids.add(int(key))
        for text in SPECIAL_TOKEN_TEXTS.values():
            tid = self.sp.piece_to_id(text)
            if text not in self.added and self.sp.id_to_piece(tid) == text:
                self.added[text] = tid
                self.special_ids.add(tid)
        self.by_id = {v: k for k, v in self.added.items()}
        self.split_re = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.added, key=len,
                                                                                 reverse=True)) + ")") \
            if self.added else None
        self.add_bos = bool(config.get("add_bos_token", False))
        self.add_eos = bool(config.get("add_eos_token", False))
        if config.get("legacy") is False:
            # transformers' non-legacy sentencepiece path rewrites the model's normalizer (no dummy prefix), which
            # this backend does not: text after a special token gets a word-start marker here and not there
            warnings.warn(f"{path.parent / 'tokenizer_config.json'}: legacy=false is not reproduced for a "
                          "sentencepiece-only tokenizer (text after a special token starts with a word-start marker "
                          "here, not in transformers); a tokenizer.json beside it gives the exact encoding",
                          stacklevel=2)

    @property
    def vocab_size(self) -> int:
        return max([self.base, *(i + 1 for i in self.added.values())])

    def token_to_id(self, text: str) -> int | None:
        if text in self.added:
            return self.added[text]
        tid = self.sp.piece_to_id(text)
        return tid if self.sp.id_to_piece(tid) == text else None

    def id_to_token(self, tid: int) -> str | None:
        if tid in self.by_id:
            return self.by_id[tid]
        return self.sp.id_to_piece(tid) if 0 <= tid < self.base else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        chunks = self.split_re.split(text) if self.split_re else [text]
        for i, chunk in enumerate(chunks):
            if i % 2:
                ids.append(self.added[chunk])
            elif chunk:
                ids += self.sp.encode(chunk, out_type=int)
        if add_special_tokens:
            if self.add_bos and self.sp.bos_id() >= 0:
                ids.insert(0, self.sp.bos_id())
            if self.add_eos and self.sp.eos_id() >= 0:
                ids.append(self.sp.eos_id())
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out, run = [], []
        for tid in ids:
            if tid in self.by_id:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if not (skip_special_tokens and tid in self.special_ids):
                    out.append(self.by_id[tid])
            elif not (skip_special_tokens and self.sp.is_control(tid)):
                run.append(tid)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------
class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special-token ids, EOS ids and chat rendering.

    Build it with `load_tokenizer`. Attributes: `vocab_size` (with added tokens), `special_ids`
    (`SpecialTokens`), `eos_token_ids` (tuple), `chat_template` (jinja2 source or None),
    `chat_template_origin` (where it came from), `tool_use_template` (the template for conversations with tools,
    when tokenizer_config.json names one "tool_use"; else None), `path` (the folder).
    """

    def __init__(self, backend: Any, *, path: Path, special_ids: SpecialTokens,
                 eos_token_ids: tuple[int, ...], chat_template: str | None, chat_template_origin: str | None,
                 template_tokens: Mapping[str, str] | None = None, tool_use_template: str | None = None):
        self._backend = backend
        # Special-token texts from tokenizer_config.json, given to the jinja2 template as transformers does.
        self.template_tokens = dict(template_tokens or {})
        self.path = path
        self.special_ids = special_ids
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.chat_template_origin = chat_template_origin
        self.tool_use_template = tool_use_template

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def token_to_id(self, text: str) -> int | None:
        """The id of a single token's text, or None."""
        return self._backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        """The text of a token id (byte-level form for BPE tokens), or None."""
        return self._backend.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token texts in `text` become their ids; with
        `add_special_tokens` the tokenizer files' post-processor decides any BOS/EOS."""
        if not isinstance(text, str):
            raise InputError(f"encode: expected a string, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens))

    def _check_ids(self, ids: Iterable[Any]) -> list[int]:
        out = []
        vocab = self.vocab_size
        for i, tid in enumerate(ids):
            try:
                value = int(tid)
            except (TypeError, ValueError):
                raise InputError(f"decode: token {i} is {tid!r}, not an integer id") from None
            if not 0 <= value < vocab:
                raise InputError(f"decode: token {i} has id {value}, outside the vocabulary [0, {vocab})")
            out.append(value)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids; incomplete UTF-8 decodes to U+FFFD. Raises InputError for bad ids."""
        return self._backend.decode(self._check_ids(ids), skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A `StreamDecoder` for this tokenizer."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def decode_streamed(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text a `StreamDecoder` streams for `ids` pushed one at a time: `decode(ids)`, except that characters
        a byte-fallback decoder would turn into U+FFFD with a later invalid byte of their run stay (what
        generation's result text is, so that it equals what was streamed)."""
        ids = self._check_ids(ids)
        text = self._backend.decode(ids, skip_special_tokens)
        if "\ufffd" not in text:  # nothing was rewritten
            return text
        stream = self.stream_decoder(skip_special_tokens)
        return "".join(stream.push(t) for t in ids) + stream.finish()

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: str = "adaptive",
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> list[int] | str:
        """Render a conversation (spec `chat.md`) and, with `tokenize`, encode it.

        Uses the checkpoint's jinja2 template when it has one (with tools, its "tool_use" template where it names
        one), else `chat.render_chat`. The rendered
        text carries its own `]~!b[`, so it is encoded without the post-processor's special tokens.
        """
        template = self.tool_use_template if tools and self.tool_use_template is not None else self.chat_template
        if template is not None and _have_jinja2():
            text = chat.render_chat_template(
                template, messages, tools, thinking, add_generation_prompt,
                origin=self.chat_template_origin or "chat template",
                extra_variables=self.template_tokens,
            )
        else:
            text = chat.render_chat(messages, tools, thinking, add_generation_prompt)
        if not tokenize:
            return text
        # Without them as single tokens BPE splits the format's markers into pieces the model never saw as markers.
        missing = [t for t in SPECIAL_TOKEN_TEXTS.values() if t in text and self.token_to_id(t) is None]
        if missing:
            raise CheckpointError(f"{self.path}: the tokenizer has no token for {', '.join(map(repr, missing))}, "
                                  "which the chat format marks turns with (spec chat.md); this tokenizer is not "
                                  "MiniMax's: use the checkpoint's own tokenizer files, or raw prompts (no chat)")
        return self.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=1)
def _have_jinja2() -> bool:
    try:
        import jinja2  # noqa: F401
    except ImportError:
        warnings.warn("jinja2 is not installed: rendering chats with the built-in renderer instead of the "
                      "checkpoint's chat template (pip install jinja2)", stacklevel=3)
        return False
    return True


class StreamDecoder:
    """Incremental detokenisation: `push(ids)` returns the new text that is complete UTF-8.

    Text is held back while it ends in an incomplete character (U+FFFD); `finish()` returns what is
    left. The pieces joined equal `tokenizer.decode(all ids)`, except where a tokenizer's decoder rewrites text it
    already gave: a byte-fallback decoder turns a whole run of byte tokens into U+FFFD once one of its bytes is
    invalid, characters completed before included. Those stay as they were streamed; the window restarts at the
    first byte token not yet part of streamed text.
    """

    # Re-anchoring keeps each decode short; the kept tokens give sentencepiece its leading-space context.
    _WINDOW = 32
    _CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._start = 0
        self._emitted = ""  # the text of decode(ids[start:]) already returned
        self._whole = (0, 0)  # (ids, characters of _emitted) at the last push that left no incomplete character

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _window(self) -> str:
        """decode(ids[start:]), restarting the window at the last whole point when it rewrote streamed text."""
        text = self._tok.decode(self._ids[self._start:], self._skip)
        if not text.startswith(self._emitted):
            at_ids, at_chars = self._whole
            if at_ids > self._start:
                self._start, self._emitted = at_ids, self._emitted[at_chars:]
                self._whole = (at_ids, 0)
                text = self._tok.decode(self._ids[self._start:], self._skip)
        return text

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text that became complete."""
        try:
            new = list(token_ids)  # type: ignore[arg-type]
        except TypeError:  # one id (int, numpy or 0-d tensor scalar)
            new = [token_ids]
        self._ids += self._tok._check_ids(new)
        text = self._window()
        stable = len(text.rstrip("\ufffd"))
        out = text[len(self._emitted):stable] if stable > len(self._emitted) else ""
        self._emitted += out
        if stable == len(text):
            self._whole = (len(self._ids), len(self._emitted))
            if len(self._ids) - self._start > self._WINDOW:
                self._start = len(self._ids) - self._CONTEXT
                self._emitted = self._tok.decode(self._ids[self._start:], self._skip)
                self._whole = (len(self._ids), len(self._emitted))
        return out

    def finish(self) -> str:
        """The rest of the text, incomplete characters included (as U+FFFD)."""
        text = self._window()
        out = text[len(self._emitted):]
        self._emitted += out
        return out


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _check_id(value: Any, vocab: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise CheckpointError(f"{where}: token id {value!r} is not an integer in [0, {vocab})")
    return value


def _chat_template(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(template, where it came from, the template for conversations with tools when the file names one apart:
    transformers' list of named templates, "default" and "tool_use")."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path), None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja_path}: cannot read ({e})") from None
    template = config.get("chat_template")
    where = f"{folder / 'tokenizer_config.json'}: chat_template"
    if template is None:
        return None, None, None
    tool_use = None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
        tool_use = named.get("tool_use")
        if tool_use is not None and not isinstance(tool_use, str):
            raise CheckpointError(f"{where}: the template named 'tool_use' is not a string")
    if not isinstance(template, str):
        raise CheckpointError(f"{where}: expected a template string (or a list of named templates)")
    return template, where, tool_use


def _dspark_noise_id(folder: Path, vocab: int) -> int | None:
    path = folder / "dspark" / "config.json"
    if not path.is_file():
        return None
    cfg = _read_json(path)
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}
    value = text_cfg.get("dspark_noise_token_id", cfg.get("dspark_noise_token_id"))
    return None if value is None else _check_id(value, vocab, f"{path}: dspark_noise_token_id")


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load the tokenizer of a checkpoint folder (or of the folder holding the given file); None: the embedded
    default checkpoint's (`embedded.default_checkpoint`, what `load_model(None)` loads).

    Reads `tokenizer.json` (else `tokenizer.model`), `tokenizer_config.json`, and when present
    `generation_config.json`, `chat_template.jinja` and `dspark/config.json`. `eos_token_ids` are
    generation_config's `eos_token_id`, then tokenizer_config's `eos_token`, then the turn-end token
    (each once). Raises CheckpointError naming the file for missing or bad files.
    """
    if path is None:
        from ..weights.embedded import default_checkpoint

        path = default_checkpoint()
    if not isinstance(path, (str, Path)):
        raise InputError(f"load_tokenizer: path must be a folder (str or Path) or None, got {type(path).__name__}")
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: tokenizer folder not found")
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    if (folder / "tokenizer.json").is_file():
        backend: Any = _TokenizersBackend(folder / "tokenizer.json", config, config_path)
    elif (folder / "tokenizer.model").is_file():
        backend = _SentencePieceBackend(folder / "tokenizer.model", config)
    else:
        raise CheckpointError(f"{folder}: no tokenizer.json (or sentencepiece tokenizer.model) found")
    vocab = backend.vocab_size

    # both backends hold tokenizer_config.json's added tokens
    ids: dict[str, int | None] = {name: backend.token_to_id(text) for name, text in SPECIAL_TOKEN_TEXTS.items()}
    noise = _dspark_noise_id(folder, vocab)
    if noise is not None:
        ids["dspark_noise"] = noise
    special = SpecialTokens(**ids)

    eos: list[int] = []
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        value = gen.get("eos_token_id") if isinstance(gen, Mapping) else None
        for v in value if isinstance(value, list) else ([] if value is None else [value]):
            eos.append(_check_id(v, vocab, f"{gen_path}: eos_token_id"))
    eos_text = _token_text(config.get("eos_token"))
    if eos_text is not None:
        tid = backend.token_to_id(eos_text)
        if tid is None:
            raise CheckpointError(f"{config_path}: eos_token {eos_text!r} is not a token of the vocabulary")
        eos.append(tid)
    if special.turn_end is not None:
        eos.append(special.turn_end)
    template, origin, tool_template = _chat_template(folder, config)
    template_tokens = {key: text for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                       if (text := _token_text(config.get(key))) is not None}
    return Tokenizer(backend, path=folder, special_ids=special, eos_token_ids=tuple(dict.fromkeys(eos)),
                     chat_template=template, chat_template_origin=origin, template_tokens=template_tokens,
                     tool_use_template=tool_template)
