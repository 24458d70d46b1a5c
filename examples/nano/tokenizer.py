"""Train the nano model's byte-level BPE tokenizer on generated data, in the release's file layout.

The conventions are `minimax_ref.tokenizer.write_test_tokenizer`'s: byte-level BPE (every byte is a
token, so any text encodes), the special tokens of `minimax_ref.tokenizer.SPECIAL_TOKEN_TEXTS` as
added tokens at the top ids in that order, no BOS added by the encoder, and the files
`tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (`chat.CHAT_TEMPLATE`, which
renders exactly what `chat.render_chat` renders).

One difference (decided here): digits are split into single-digit tokens before BPE, so that
"391" is always the tokens 3, 9, 1. Column arithmetic and copying order ids then work digit by digit
instead of on whatever multi-digit chunks the merges happened to learn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from minimax_ref import chat
from minimax_ref.tokenizer import MIN_TEST_VOCAB, SPECIAL_TOKEN_TEXTS


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> dict[str, int]:
    """Train a BPE tokenizer of exactly `vocab_size` ids (special tokens included) on `texts` and write
    it to `out_dir`. Returns the special-token ids by attribute name (`SPECIAL_TOKEN_TEXTS` keys).

    When the texts do not support enough merges, the remaining ids are unused `<|reserved_N|>` tokens, so
    the vocabulary size (the embedding's row count) is always what was asked. The same texts give the
    same files. Raises ValueError below `MIN_TEST_VOCAB`.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

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

    have = tok.get_vocab_size(with_added_tokens=False)
    if have < n_bpe:
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        for i in range(n_bpe - have):
            vocab[f"<|reserved_{i}|>"] = have + i
        tok = HFTokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKEN_TEXTS.values()])
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
