"""One shared byte-level BPE vocabulary for both languages (paper Section 5.1).

The paper used a shared source-target BPE vocabulary of about 37000 tokens for WMT14
En-De. We train it with Hugging Face ``tokenizers`` on both sides of the training split.

Byte-level BPE is lossless: there is no normalisation and no whitespace pre-tokenisation
that throws information away, so ``decode(encode(text)) == text`` for every UTF-8 string
(repeated spaces, quotes, umlauts, hyphenated compounds included). Detokenisation then
needs no Moses-style guessing, and sacreBLEU scores exactly the text the model produced.
That holds for text that spells a special token too ("<pad>", "</s>"): it is encoded as the
bytes it is written with, never as the control id (:func:`literal_special_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from aiayn.errors import DataError
from aiayn.io import atomic_path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in this order
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # add_prefix_space=False keeps the first word as written: no invented leading space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return literal_special_tokens(tok)


def literal_special_tokens(tok: Tokenizer) -> Tokenizer:
    """``tok``, set to encode the text of a special token as text. By default `tokenizers`
    matches "<pad>", "<s>", "</s>" and "<unk>" inside any text, even with
    ``add_special_tokens=False``: a sentence that spells one would train with a PAD, BOS or
    EOS id in its middle (a PAD label ignored by the loss, a target that ends twice). The
    setting is not saved in tokenizer.json, so every load sets it again."""
    tok.encode_special_tokens = True
    return tok


def train_bpe(texts: Iterable[str] | Iterable[list[str]], vocab_size: int, min_frequency: int,
              length: int | None = None) -> Tokenizer:
    """Train shared BPE on sentences of both languages (single strings or lists of them).

    ``length`` (number of sentences) only feeds the progress display.
    """
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the alphabet, so no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == token_id, "special tokens must take ids 0-3"
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        tok.save(str(tmp))


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no tokenizer; run the vocab stage first (`aiayn vocab`)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(
            f"{path}: not a tokenizers JSON file ({exc}); re-run `aiayn vocab`"
        ) from None
    # tokenizers memoises the BPE split of 10k words by default; a far larger memo was
    # tried on a WMT-sized corpus and was slower and larger (bench/README.md).
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != token_id:
            raise DataError(
                f"{path}: special token {token!r} must have id {token_id}, has "
                f"{tok.token_to_id(token)}; this tokenizer was not made by `aiayn vocab`"
            )
    return literal_special_tokens(tok)


def encode_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def decode(tok: Tokenizer, ids: Iterable[int]) -> str:
    """Text of a token sequence; special tokens are dropped."""
    return tok.decode([i for i in ids if i >= len(SPECIAL_TOKENS)], skip_special_tokens=True)
