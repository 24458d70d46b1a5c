"""Train the nano model's byte-level BPE tokenizer on generated data, in the release's file layout.

The conventions are `minimax_ref.weights.synth_tokenizer.write_test_tokenizer`'s: byte-level BPE (every byte is a
token, so any text encodes), the special tokens of `minimax_ref.generation.tokenizer.SPECIAL_TOKEN_TEXTS` as
added tokens at the top ids in that order, no BOS added by the encoder, and the files
`tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (`chat.CHAT_TEMPLATE`, which
renders exactly what `chat.render_chat` renders).

One difference (decided here): digits are split into single-digit tokens before BPE, so that
"391" is always the tokens 3, 9, 1. Column arithmetic and copying order ids then work digit by digit
instead of on whatever multi-digit chunks the merges happened to learn.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from minimax_ref.generation.tokenizer import SPECIAL_TOKEN_TEXTS
from minimax_ref.weights.synth_tokenizer import MIN_TEST_VOCAB, save_trained_tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> dict[str, int]:
    """Train a BPE tokenizer of exactly `vocab_size` ids (special tokens included) on `texts` and write
    it to `out_dir`. Returns the special-token ids by attribute name (`SPECIAL_TOKEN_TEXTS` keys).

    When the texts do not support enough merges, the remaining ids are unused `<|reserved_N|>` tokens, so
    the vocabulary size (the embedding's row count) is always what was asked. The same texts give the
    same files. Raises ValueError below `MIN_TEST_VOCAB`.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_TEST_VOCAB:
        raise ValueError(f"vocab_size={vocab_size}: needs at least {MIN_TEST_VOCAB} ids")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_bpe = vocab_size - len(SPECIAL_TOKEN_TEXTS)

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(texts, trainer)

    return save_trained_tokenizer(tok, out, vocab_size)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
