"""Subword splitting: training batches re-segmented at random, a regulariser for small corpora.

Every token the BPE learned by a merge ``(a, b) -> ab`` can be written as its two parts
``a b`` without changing the text: both are tokens of the same vocabulary, and the model's
embedding knows them. :class:`SubwordSplitter` replaces each merged token of a training
sequence by its two parts with probability ``p``, and each part that is itself merged again
with probability ``p``, down to single bytes. The model so sees the same sentence in several
segmentations over the epochs, and the rarer short tokens get trained in context; decoding
and validation keep the deterministic segmentation.

It is a top-down relative of BPE-dropout (Provilkov et al., 2020, "BPE-Dropout: Simple and
Effective Subword Regularization"), which drops each merge while re-running BPE from the
characters. Undoing merges of the finished segmentation needs no tokenizer at training
time, costs a few vectorised numpy passes per batch, and is reproducible: the random draws
come from ``(seed, epoch, batch index, side)``, so a resumed run sees the same segmentations
an uninterrupted one would have seen.
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer

from aiayn.errors import DataError

NO_PARENT = -1


def merge_parents(tok: Tokenizer) -> np.ndarray:
    """[vocab, 2] int64: the two token ids each merged token was made of; ``-1`` for the
    tokens no merge made (special tokens, single bytes)."""
    model = json.loads(tok.to_str())["model"]
    if model.get("type") != "BPE":
        raise DataError(f"subword splitting needs a BPE tokenizer, this one is "
                        f"{model.get('type')!r}; set train.subword_split: 0")
    vocab: dict[str, int] = model["vocab"]
    parents = np.full((tok.get_vocab_size(), 2), NO_PARENT, dtype=np.int64)
    for merge in model["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(a + b)
        if merged is None or a not in vocab or b not in vocab:
            raise DataError(f"tokenizer merge {a!r} + {b!r} names a token that is not in its "
                            "vocabulary; re-run `aiayn vocab`")
        parents[merged] = (vocab[a], vocab[b])
    return parents


def split_closure(seen: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """``seen`` (bool per token) with every token that splitting a seen token can yield,
    down to single bytes: the tokens a :class:`SubwordSplitter` may put in a sequence made
    of seen tokens."""
    seen = seen.copy()
    frontier = np.flatnonzero(seen)
    while frontier.size:
        parts = parents[frontier].ravel()
        parts = np.unique(parts[parts != NO_PARENT])
        frontier = parts[~seen[parts]]
        seen[frontier] = True
    return seen


class SubwordSplitter:
    """Splits merged tokens of a batch's sequences at random (see the module docstring).

    ``max_len`` bounds a sequence after splitting (the model's positions); a sequence that
    would grow past it keeps its original segmentation.
    """

    def __init__(self, parents: np.ndarray, p: float, seed: int, max_len: int):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"split probability must be in [0, 1), not {p}")
        if parents.ndim != 2 or parents.shape[1] != 2:
            raise ValueError(f"parents must be [vocab, 2], not {list(parents.shape)}")
        self.parents, self.p, self.seed, self.max_len = parents, p, seed, max_len

    def __call__(self, flat: np.ndarray, lengths: np.ndarray, key: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray]:
        """``flat`` holds ``len(lengths)`` sequences one after the other; returns the same
        sequences re-segmented, and their new lengths. Deterministic in ``key``."""
        if self.p == 0.0 or flat.size == 0:
            return flat, lengths
        rng = np.random.default_rng([self.seed, *key])
        seq = np.repeat(np.arange(lengths.size), lengths)
        tokens, owner = flat, seq
        open_ = np.ones(flat.size, dtype=bool)  # tokens that still get a draw
        while True:
            split = open_ & (self.parents[tokens, 0] != NO_PARENT)
            split &= rng.random(tokens.size) < self.p
            if not split.any():
                break
            width = 1 + split.astype(np.int64)
            first = np.cumsum(width) - width  # where each old token lands
            at = first[split]
            new_tokens = np.repeat(tokens, width)
            new_tokens[at] = self.parents[tokens[split], 0]
            new_tokens[at + 1] = self.parents[tokens[split], 1]
            open_ = np.zeros(new_tokens.size, dtype=bool)
            open_[at] = open_[at + 1] = True  # only the new parts may split further
            tokens, owner = new_tokens, np.repeat(owner, width)
        new_lengths = np.bincount(owner, minlength=lengths.size)
        fits = new_lengths <= self.max_len
        if fits.all():
            return tokens, new_lengths
        # Too long after splitting: that sequence keeps its original tokens, in place.
        keep_new, keep_old = fits[owner], ~fits[seq]
        order = np.argsort(np.concatenate([owner[keep_new], seq[keep_old]]), kind="stable")
        tokens = np.concatenate([tokens[keep_new], flat[keep_old]])[order]
        return tokens, np.where(fits, new_lengths, lengths)
