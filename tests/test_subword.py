"""Subword splitting (train.subword_split): the same text, more tokens, reproducible draws."""

from __future__ import annotations

import itertools
import json
from functools import cache

import numpy as np
import pytest

from aiayn.data.sampler import BatchLoader, PrefetchLoader, ShardDataset, TokenBudgetSampler
from aiayn.data.subword import NO_PARENT, SubwordSplitter, merge_parents
from aiayn.data.tokenizer import SPECIAL_TOKENS, decode, encode_ids, train_bpe
from aiayn.errors import DataError
from tests.test_sampler import write_split

SENTENCES = [
    "Two young children are playing with a ball in the garden.",
    "Zwei kleine Kinder spielen im Garten mit einem Ball.",
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "Ein Mann in einem blauen Hemd steht auf einer Leiter und putzt Fenster.",
    "Several women wait outside in a city.",
    "Mehrere Frauen warten draußen in einer Stadt.",
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_bpe(SENTENCES, vocab_size=400, min_frequency=2)


def flat_ids(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = encode_ids(tok, texts)
    return (np.array(list(itertools.chain(*ids)), dtype=np.int64),
            np.array([len(i) for i in ids], dtype=np.int64))


def unflatten(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [flat[e - n:e].tolist() for e, n in zip(ends, lengths, strict=True)]


def test_merge_parents_spell_every_merged_token(tok):
    parents = merge_parents(tok)
    merged = np.flatnonzero(parents[:, 0] != NO_PARENT)
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert merged.size == len(merges) > 0
    for t in merged:
        a, b = parents[t]
        assert tok.id_to_token(int(a)) + tok.id_to_token(int(b)) == tok.id_to_token(int(t))
    for t in np.flatnonzero(parents[:, 0] == NO_PARENT):  # specials and single bytes
        assert t < len(SPECIAL_TOKENS) or len(tok.id_to_token(int(t))) == 1


def test_a_tokenizer_that_is_not_bpe_is_refused():
    from tokenizers import Tokenizer, models

    wordlevel = Tokenizer(models.WordLevel({"<pad>": 0, "a": 1}, unk_token="<pad>"))
    with pytest.raises(DataError, match="subword_split: 0"):
        merge_parents(wordlevel)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.95])
def test_split_sequences_spell_the_same_text_with_more_tokens(tok, p):
    texts = SENTENCES[:6]
    flat, lengths = flat_ids(tok, texts)
    splitter = SubwordSplitter(merge_parents(tok), p, seed=1, max_len=10_000)
    out, new_lengths = splitter(flat, lengths, (0, 0, 0))
    assert new_lengths.sum() == out.size and out.size > flat.size
    assert (new_lengths >= lengths).all()
    for ids, text in zip(unflatten(out, new_lengths), texts, strict=True):
        assert decode(tok, ids) == text


def test_split_zero_is_the_identity_and_keys_fix_the_draws(tok):
    flat, lengths = flat_ids(tok, SENTENCES[:6])
    parents = merge_parents(tok)
    out, new = SubwordSplitter(parents, 0.0, 1, 10_000)(flat, lengths, (0, 0, 0))
    assert np.array_equal(out, flat) and np.array_equal(new, lengths)
    splitter = SubwordSplitter(parents, 0.3, 1, 10_000)
    first = splitter(flat, lengths, (2, 7, 1))[0]
    assert np.array_equal(first, splitter(flat, lengths, (2, 7, 1))[0])
    assert not np.array_equal(first, splitter(flat, lengths, (3, 7, 1))[0])  # next epoch
    assert not np.array_equal(first, SubwordSplitter(parents, 0.3, 2, 10_000)(
        flat, lengths, (2, 7, 1))[0])  # another seed


def test_special_tokens_are_never_split():
    # 5 = (4, 4), 6 = (5, 5): a two-level tree; 0-3 are specials
    parents = np.full((7, 2), NO_PARENT)
    parents[5], parents[6] = (4, 4), (5, 5)
    flat = np.array([1, 6, 6, 2, 1, 5, 2])
    lengths = np.array([4, 3])
    out, new = SubwordSplitter(parents, 0.9, 0, 100)(flat, lengths, (0,))
    seqs = unflatten(out, new)
    assert [s[0] for s in seqs] == [1, 1] and [s[-1] for s in seqs] == [2, 2]
    assert set(out.tolist()) <= {1, 2, 4, 5, 6}


@cache
def expected_length(parents_key: bytes, token: int, p: float) -> float:
    """E[number of tokens token becomes]: kept with 1 - p, else the sum over its parts."""
    parents = np.frombuffer(parents_key, dtype=np.int64).reshape(-1, 2)
    a, b = parents[token]
    if a == NO_PARENT:
        return 1.0
    return (1 - p) + p * (expected_length(parents_key, int(a), p)
                          + expected_length(parents_key, int(b), p))


def test_the_number_of_tokens_matches_the_splitting_probability(tok):
    parents = merge_parents(tok)
    flat, lengths = flat_ids(tok, SENTENCES[:6])
    p, draws = 0.3, 400
    splitter = SubwordSplitter(parents, p, seed=5, max_len=10_000)
    sizes = np.array([splitter(flat, lengths, (k,))[0].size for k in range(draws)])
    key = parents.tobytes()
    expected = sum(expected_length(key, int(t), p) for t in flat)
    # The mean of 400 draws lies within 4 standard errors of the recursion's expectation.
    assert abs(sizes.mean() - expected) < 4 * sizes.std() / np.sqrt(draws) + 1e-9
    assert sizes.std() > 0


def test_a_sequence_that_would_outgrow_max_len_keeps_its_segmentation():
    parents = np.full((11, 2), NO_PARENT)
    parents[10] = (4, 5)
    flat = np.array([10, 10, 10, 10, 10])
    lengths = np.array([1, 3, 1])  # [10], [10 10 10], [10]
    splitter = SubwordSplitter(parents, 0.9, seed=0, max_len=3)
    out, new = splitter(flat, lengths, (0,))
    # Each short one splits (to 2 tokens, within the limit); the long one would reach 4-6.
    assert unflatten(out, new) == [[4, 5], [10, 10, 10], [4, 5]]
    assert new.tolist() == [2, 3, 2]


def test_invalid_splitter_arguments():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        SubwordSplitter(np.zeros((3, 2), np.int64), 1.0, 0, 10)
    with pytest.raises(ValueError, match="vocab, 2"):
        SubwordSplitter(np.zeros((3, 3), np.int64), 0.1, 0, 10)


# --------------------------------------------------------------------------- in the loader

# The hand-made split of tests/test_sampler.py uses ids 5-27; make a few of them merges.
TOY_PARENTS = np.full((100, 2), NO_PARENT)
for merged, parts in {6: (50, 51), 7: (6, 52), 12: (53, 54), 13: (12, 55), 26: (56, 57)}.items():
    TOY_PARENTS[merged] = parts


def leaves(ids: list[int]) -> list[int]:
    """Every merged token written out down to tokens no merge made (a brute-force spelling)."""
    out = []
    for t in ids:
        a, b = TOY_PARENTS[t]
        out += [t] if a == NO_PARENT else leaves([int(a), int(b)])
    return out


def spelled(batch) -> list[tuple]:
    src = [leaves([t for t in row if t]) for row in batch.src.tolist()]
    tgt = [leaves([t for t in row if t]) for row in batch.tgt_out.tolist()]
    return list(zip(batch.rows.tolist(), map(tuple, src), map(tuple, tgt), strict=True))


def loader(dataset, splitter=None, seed=3) -> BatchLoader:
    return BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches, seed=seed),
                       splitter=splitter)


def test_the_loader_splits_training_batches_into_the_same_pairs(tmp_path):
    dataset = ShardDataset(write_split(tmp_path / "train"))
    splitter = SubwordSplitter(TOY_PARENTS, 0.5, seed=0, max_len=64)
    plain = list(itertools.islice(loader(dataset), 12))
    split = list(itertools.islice(loader(dataset, splitter), 12))
    assert [b.index for b in plain] == [b.index for b in split]
    assert [spelled(b) for b in plain] == [spelled(b) for b in split]
    assert sum(b.src_tokens + b.tgt_tokens for b in split) > \
        sum(b.src_tokens + b.tgt_tokens for b in plain)
    for b in split:  # labels and decoder inputs stay shifted by one, padding where it was
        assert b.tgt_tokens == int((b.tgt_out != 0).sum()) == b.tgt_positions.numel()
        assert (b.tgt_in[:, 0] == 1).all()
        real = b.tgt_out != 0
        assert (b.tgt_in[:, 1:][real[:, 1:]] == b.tgt_out[:, :-1][real[:, 1:]]).all()
    # Batch 0 seen in two epochs: the same pairs, segmented afresh.
    seen = [batch_key(b) for b in split if b.index == 0]
    assert len(seen) >= 2 and len(set(seen)) > 1


def batch_key(b) -> tuple:
    return (b.index, str(b.src.tolist()), str(b.tgt_in.tolist()), str(b.tgt_out.tolist()))


def test_prefetching_with_splitting_yields_the_same_batches_and_resumes(tmp_path):
    dataset = ShardDataset(write_split(tmp_path / "train"))
    splitter = SubwordSplitter(TOY_PARENTS, 0.5, seed=0, max_len=64)
    expected = [batch_key(b) for b in itertools.islice(loader(dataset, splitter), 10)]
    ahead = PrefetchLoader(loader(dataset, splitter), depth=3)
    got = [batch_key(b) for b in itertools.islice(ahead, 4)]
    state = ahead.state_dict()
    ahead.close()
    resumed = PrefetchLoader(loader(dataset, splitter))
    resumed.load_state_dict(state)
    got += [batch_key(b) for b in itertools.islice(resumed, 6)]
    resumed.close()
    assert got == expected
