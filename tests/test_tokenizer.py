"""Shared BPE: lossless round trip on real text, special ids, clear errors."""

from __future__ import annotations

import pytest

from aiayn.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    decode,
    encode_ids,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)
from aiayn.errors import DataError
from tests.conftest import SENTENCES_DE, SENTENCES_EN

UNSEEN = [
    "Völlig neue Wörter: Äpfel, Öfen, Übergrößenträger, Mäßigung — 100 % „sicher“!",
    "Emoji 🙂 and CJK 漢字 and accents: naïve café coöperation, Œuvre.",
    "  leading and trailing spaces  ",
    "multiple\t\ttabs   and     runs of spaces",
    "Bindestrich-Komposita wie Donaudampfschifffahrts-Gesellschaft und E-Mail-Adresse.",
    "",
]


@pytest.fixture(scope="module")
def tok():
    corpus = (SENTENCES_EN + SENTENCES_DE) * 20
    return train_bpe(iter(corpus), vocab_size=400, min_frequency=2)


@pytest.mark.parametrize("text", SENTENCES_EN + SENTENCES_DE + UNSEEN)
def test_decode_gives_back_the_exact_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert decode(tok, ids) == text
    # Special tokens around the sequence are dropped on decoding.
    assert decode(tok, [BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == text


def test_text_that_spells_a_special_token_is_text(tok, tmp_path):
    """`tokenizers` matches added special tokens inside text unless told not to: "<pad>" in
    a sentence would become PAD (id 0) in the middle of a training pair."""
    texts = ["A <pad> dog runs.", "Die Katze </s> schläft <s> x<unk>y", "<pad>"]
    path = tmp_path / "tokenizer.json"
    save_tokenizer(tok, path)
    for t in (tok, load_tokenizer(path)):
        for text, ids in zip(texts, encode_ids(t, texts), strict=True):
            assert not set(ids) & {PAD_ID, BOS_ID, EOS_ID, UNK_ID}
            assert decode(t, ids) == text


def test_special_tokens_have_fixed_ids(tok):
    assert [tok.id_to_token(i) for i in (PAD_ID, BOS_ID, EOS_ID, UNK_ID)] == [
        "<pad>", "<s>", "</s>", "<unk>"]


def test_byte_level_never_produces_unknown(tok):
    for ids in encode_ids(tok, UNSEEN):
        assert UNK_ID not in ids


def test_merges_shorten_frequent_words(tok):
    # A word seen 40 times in training becomes far fewer tokens than its bytes.
    assert len(encode_ids(tok, ["Das Haus ist klein."])[0]) < len("Das Haus ist klein.") // 2


def test_vocab_size_is_respected():
    corpus = [f"word{i} other{i * 7} thing{i % 13}" for i in range(3000)]
    tok = train_bpe(iter(corpus), vocab_size=600, min_frequency=1)
    assert tok.get_vocab_size() == 600


def test_save_and_load(tok, tmp_path):
    path = tmp_path / "vocab" / "tokenizer.json"
    save_tokenizer(tok, path)
    loaded = load_tokenizer(path)
    assert encode_ids(loaded, SENTENCES_DE) == encode_ids(tok, SENTENCES_DE)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no tokenizer; run the vocab stage"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=f"{bad}: not a tokenizers JSON"):
        load_tokenizer(bad)


def test_vocab_sample_is_exact_evenly_spread_and_batch_independent():
    from stages.vocab import sample_rows

    n_rows, n_pairs = 1003, 100
    whole = sample_rows(0, n_rows, n_pairs, n_rows)
    assert len(whole) == n_pairs
    assert max(b - a for a, b in zip(whole, whole[1:], strict=False)) <= 11  # spread out
    in_batches = [start + i for start in range(0, n_rows, 64)
                  for i in sample_rows(start, min(64, n_rows - start), n_pairs, n_rows)]
    assert in_batches == whole
    assert sample_rows(0, 10, 10, 10) is None and sample_rows(0, 10, 50, 10) is None
