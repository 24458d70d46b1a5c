"""The project's small test tokenizer: a byte-level BPE (every byte is a token, so any text encodes)
trained on a built-in corpus, with the release's special tokens at the top ids, in the release's file
layout (spec `chat.md`).

`write_test_tokenizer(out_dir, vocab_size)` trains and writes it for synthetic checkpoints (`synth`),
the CLI's `--synthetic-weights` runs and the tests; `save_trained_tokenizer` lays out and writes any
trained byte-level BPE the same way (the nano example trains its own on generated text). Reading the
files back is `generation.tokenizer`'s job.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ..generation import chat
from ..generation.tokenizer import SPECIAL_TOKEN_TEXTS

#: The smallest vocabulary `write_test_tokenizer` accepts: the 256 byte tokens, the special tokens
#: and a few merges.
MIN_TEST_VOCAB = 256 + len(SPECIAL_TOKEN_TEXTS) + 64
# Above this many BPE tokens, training takes too long for tests; the rest are unused filler tokens.
_MAX_TRAINED_BPE = 8192

_CORPUS = """\
The tokenizer of a language model turns text into integers and back again. Small models are fast to
test: every layer is tiny, every matrix fits in a cache line or two, and the whole forward pass takes
a few milliseconds on a laptop. We travelled from Yaoundé to Genève, then on to Zürich, Kraków,
São Paulo, Reykjavík and Düsseldorf; the café served crème brûlée, jalapeño soup and a piña colada.
What is the weather in Lisbon today? It is 21 degrees, sunny, with a light breeze from the north-west.
Order RD-57931-D6 shipped on 2024-03-17 at 09:45; the invoice total was 1,234.56 EUR (VAT 23%).
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 64 99 100 128 256 512 1024 2048 4096 65536 3.14159 2.71828
def add(x: int, y: int) -> int:
    return x + y

for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)

{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": "metric"}}
<html><body><p class="note">Hello &amp; welcome!</p></body></html>
SELECT id, name FROM users WHERE age >= 18 ORDER BY name;
Please think step by step, then answer. The answer is 4. Let me check the tool result first.
"""

_LETTERS = "abcdefghijklmnopqrstuvwxyzéèàüöç"


def _training_corpus(seed: int, n_merges: int) -> list[str]:
    # Pseudo-words give the trainer enough distinct pairs to reach any merge count we ask for.
    rng = random.Random(seed)
    words = ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 9)))
             for _ in range(n_merges // 2 + 100)]
    lines = _CORPUS.splitlines(keepends=True) * 4
    lines += [" ".join(words[i:i + 12]) + "\n" for i in range(0, len(words), 12)]
    return lines


def save_trained_tokenizer(tok: Any, out: Path, vocab_size: int) -> dict[str, int]:
    """Finish a trained byte-level BPE `tokenizers.Tokenizer` the way the release lays its vocabulary
    out, and write it: BPE ids first (padded with unused `<|reserved_N|>` entries up to
    `vocab_size - len(SPECIAL_TOKEN_TEXTS)`), then the special tokens at the top ids;
    `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` in `out`. Returns the
    special-token ids by attribute name."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    n_bpe = vocab_size - len(SPECIAL_TOKEN_TEXTS)
    have = tok.get_vocab_size(with_added_tokens=False)
    if have < n_bpe:
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        for i in range(n_bpe - have):
            vocab[f"<|reserved_{i}|>"] = have + i
        tok = HFTokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKEN_TEXTS.values()])
    ids = {name: tok.token_to_id(text) for name, text in SPECIAL_TOKEN_TEXTS.items()}
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size or min(ids.values()) != n_bpe:
        raise AssertionError("tokenizer: vocabulary size or special-token ids came out wrong")

    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(ids[name]): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True}
            for name, text in SPECIAL_TOKEN_TEXTS.items()
        },
        "bos_token": chat.BOD,
        "clean_up_tokenization_spaces": False,
        "eos_token": chat.TURN_END,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    (out / "chat_template.jinja").write_text(chat.CHAT_TEMPLATE, encoding="utf-8")
    return {name: int(tid) for name, tid in ids.items()}


def write_test_tokenizer(out_dir: str | Path, vocab_size: int, *, seed: int = 0) -> dict[str, int]:
    """Write a byte-level BPE tokenizer of exactly `vocab_size` ids (special tokens included).

    Files: `tokenizer.json`, `tokenizer_config.json` (bos/eos, `added_tokens_decoder`, no template)
    and `chat_template.jinja` (`chat.CHAT_TEMPLATE`). The special tokens of `SPECIAL_TOKEN_TEXTS`
    take the top ids in that order; the encoder adds no BOS. Vocabularies above 8192 BPE tokens
    are filled with unused `<|reserved_N|>` tokens. The same arguments give the same bytes.
    Returns the special ids by attribute name. Raises ValueError below `MIN_TEST_VOCAB`.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_TEST_VOCAB:
        raise ValueError(f"vocab_size={vocab_size!r}: the test tokenizer needs at least {MIN_TEST_VOCAB} ids "
                         f"(256 bytes, {len(SPECIAL_TOKEN_TEXTS)} special tokens and some merges)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_bpe = vocab_size - len(SPECIAL_TOKEN_TEXTS)
    n_trained = min(n_bpe, _MAX_TRAINED_BPE)

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=n_trained, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(_training_corpus(seed, n_trained - 256), trainer)

    return save_trained_tokenizer(tok, out, vocab_size)
