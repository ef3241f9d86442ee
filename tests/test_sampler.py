"""The reader side: padded batches from shard folders, and the per-rank batch order."""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data.sampler import (
    EMPTY,
    Batch,
    BatchLoader,
    PrefetchLoader,
    ShardDataset,
    TokenBudgetSampler,
)
from aiayn.data.shards import FORMAT, FORMAT_VERSION
from aiayn.errors import DataError

# --------------------------------------------------------------------------- a hand-made split

# Pairs as (source ids, target ids) without specials; ids >= 4 are ordinary tokens.
PAIRS = [([5, 6, 7], [11]), ([8], [12, 13, 14]), ([9, 10], [15, 16]),
         ([20], [21]), ([22, 23, 24, 25], [26, 27])]
RAW_ROWS = [40, 41, 42, 43, 44]
# shard 0 holds pairs 0-2 (batches: rows 0-1, row 2), shard 1 pairs 3-4 (one batch)
SHARDS = [(0, 3), (3, 5)]
BATCHES = [[0, 0, 2], [0, 2, 3], [1, 0, 2]]


def write_split(folder: Path, **meta_overrides) -> Path:
    """A split folder in the documented format, written without aiayn.data.shards."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for k, (lo, hi) in enumerate(SHARDS):
        name = f"shard-{k:05d}"
        src = [ids + [2] for ids, _ in PAIRS[lo:hi]]
        tgt = [[1] + ids + [2] for _, ids in PAIRS[lo:hi]]
        for side, seqs in (("src", src), ("tgt", tgt)):
            np.save(folder / f"{name}.{side}.npy", np.array(sum(seqs, []), dtype=np.uint16))
            np.save(folder / f"{name}.{side}_offsets.npy",
                    np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64))
        entries.append({"name": name, "pairs": hi - lo, "first_pair": lo,
                        "batches": sum(b[0] == k for b in BATCHES)})
    np.save(folder / "batches.npy", np.array(BATCHES, dtype=np.int64))
    np.save(folder / "rows.npy", np.array(RAW_ROWS, dtype=np.int64))
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "split": "train",
            "src_lang": "en", "tgt_lang": "de", "vocab_size": 100, "dtype": "uint16",
            "pad_id": 0, "bos_id": 1, "eos_id": 2, "num_pairs": len(PAIRS),
            "num_batches": len(BATCHES), "shards": entries, **meta_overrides}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture
def dataset(tmp_path) -> ShardDataset:
    return ShardDataset(write_split(tmp_path / "train"))


def test_batch_tensors_are_padded_and_shifted(dataset):
    b = dataset.batch(0)
    assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == b.rows.dtype == torch.long
    assert b.src.tolist() == [[5, 6, 7, 2], [8, 2, 0, 0]]
    assert b.tgt_in.tolist() == [[1, 11, 0, 0], [1, 12, 13, 14]]
    assert b.tgt_out.tolist() == [[11, 2, 0, 0], [12, 13, 14, 2]]
    assert b.rows.tolist() == [40, 41]
    assert (b.src_tokens, b.tgt_tokens) == (6, 6)
    assert len(b) == b.num_pairs == 2 and b.index == 0


def test_batch_of_second_shard_and_single_pair(dataset):
    b = dataset.batch(2)
    assert b.src.tolist() == [[20, 2, 0, 0, 0], [22, 23, 24, 25, 2]]
    assert b.tgt_in.tolist() == [[1, 21, 0], [1, 26, 27]]
    assert b.tgt_out.tolist() == [[21, 2, 0], [26, 27, 2]]
    assert b.rows.tolist() == [43, 44]
    single = dataset.batch(1)
    assert single.src.shape == (1, 3) and single.tgt_in.shape == single.tgt_out.shape == (1, 3)


def test_labels_are_pad_exactly_where_padding_is(dataset):
    for i in range(dataset.num_batches):
        b = dataset.batch(i)
        # tgt_in and tgt_out have the same real length per row: label t follows input t
        assert torch.equal(b.tgt_in != 0, b.tgt_out != 0)
        assert int((b.tgt_out != 0).sum()) == b.tgt_tokens
        assert int((b.src != 0).sum()) == b.src_tokens
        # the loader's own list of the real target positions (flat, row-major)
        assert b.tgt_positions.tolist() == torch.nonzero(b.tgt_out.reshape(-1)).squeeze(1).tolist()


def test_empty_batch(dataset):
    b = dataset.batch(EMPTY)
    assert len(b) == 0 and b.is_empty and b.src_tokens == b.tgt_tokens == 0
    assert b.src.shape[0] == b.tgt_in.shape[0] == b.tgt_out.shape[0] == b.rows.numel() == 0
    assert b.tgt_positions.numel() == 0
    assert Batch.empty().src.dtype == torch.long


def test_dataset_pickles_as_its_path(dataset):
    payload = pickle.dumps(dataset)
    assert len(payload) < 1000  # not the token arrays
    again = pickle.loads(payload)
    assert again.batch(2).src.tolist() == dataset.batch(2).src.tolist()


def test_out_of_range_batch(dataset):
    with pytest.raises(IndexError):
        dataset.batch(len(BATCHES))


def test_batch_to_device_keeps_fields(dataset):
    b = dataset.batch(0).to("cpu")
    assert b.rows.tolist() == [40, 41] and b.tgt_tokens == 6 and b.index == 0
    assert b.tgt_positions.tolist() == [0, 1, 4, 5, 6, 7]


@pytest.mark.parametrize(("change", "message"), [
    (lambda f: (f / "meta.json").unlink(), r"meta\.json: missing"),
    (lambda f: (f / "meta.json").write_text("{not json"), r"meta\.json: not readable JSON"),
    (lambda f: write_split(f, format_version=FORMAT_VERSION + 1), r"'format_version' is"),
    (lambda f: write_split(f, num_batches=7), r"batches\.npy: shape"),
    (lambda f: (f / "shard-00001.tgt.npy").unlink(), r"shard-00001\.tgt\.npy: cannot be read"),
])
def test_bad_split_folder_is_refused_with_the_file_named(tmp_path, change, message):
    folder = write_split(tmp_path / "train")
    change(folder)
    with pytest.raises(DataError, match=message):
        ShardDataset(folder)


def test_truncated_shard_is_refused(tmp_path):
    folder = write_split(tmp_path / "train")
    np.save(folder / "shard-00000.src.npy", np.zeros(3, dtype=np.uint16))
    with pytest.raises(DataError, match=r"shard-00000\.src\.npy: size disagrees"):
        ShardDataset(folder)


# --------------------------------------------------------------------------- the sampler


def take(sampler: TokenBudgetSampler, n: int) -> list[int]:
    return list(itertools.islice(sampler, n))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("num_batches", [1, 7, 10, 12])
def test_ranks_are_disjoint_and_cover_every_batch_each_epoch(world, num_batches):
    per_rank = -(-num_batches // world)
    samplers = [TokenBudgetSampler(num_batches, r, world, seed=3) for r in range(world)]
    for _epoch in range(3):
        streams = [take(s, per_rank) for s in samplers]
        real = [i for stream in streams for i in stream if i != EMPTY]
        assert sorted(real) == list(range(num_batches))  # each batch exactly once
        empties = sum(stream.count(EMPTY) for stream in streams)
        assert empties == per_rank * world - num_batches
        # empties only in the last round, so no rank idles before the epoch's end
        assert all(EMPTY not in stream[:-1] for stream in streams)


def test_every_rank_yields_the_same_count_per_epoch():
    for world in (2, 3, 4):
        counts = [len(list(TokenBudgetSampler(10, r, world).epoch_iter())) for r in range(world)]
        assert counts == [-(-10 // world)] * world


def test_order_is_deterministic_and_seeded():
    a = take(TokenBudgetSampler(50, 1, 2, seed=7), 60)
    b = take(TokenBudgetSampler(50, 1, 2, seed=7), 60)
    c = take(TokenBudgetSampler(50, 1, 2, seed=8), 60)
    assert a == b and a != c


def test_order_ignores_torch_global_rng():
    torch.manual_seed(0)
    a = take(TokenBudgetSampler(30, seed=1), 30)
    torch.manual_seed(123)
    torch.rand(100)
    assert take(TokenBudgetSampler(30, seed=1), 30) == a


def test_epochs_reshuffle():
    s = TokenBudgetSampler(40, seed=1)
    first, second = take(s, 40), take(s, 40)
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second
    assert s.state_dict() == {"epoch": 1, "position": 40}
    assert take(s, 1)[0] == TokenBudgetSampler(40, seed=1).order(2)[0]


def test_no_shuffle_keeps_batch_order():
    s = TokenBudgetSampler(5, rank=1, world_size=2, shuffle=False)
    assert list(s.epoch_iter()) == [1, 3, EMPTY]


@pytest.mark.parametrize("stop", [0, 5, 13, 14, 15, 27, 40])
def test_resume_continues_the_uninterrupted_stream(stop):
    """14 batches over 3 ranks = 5 per rank per epoch: stops mid-epoch and at boundaries."""
    reference = take(TokenBudgetSampler(14, 2, 3, seed=11), 60)
    first = TokenBudgetSampler(14, 2, 3, seed=11)
    head = take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = TokenBudgetSampler(14, 2, 3, seed=11)
    resumed.load_state_dict(state)
    assert head + take(resumed, 60 - stop) == reference


def test_epoch_iter_then_stream_resume():
    s = TokenBudgetSampler(9, 0, 2, seed=4)
    first_epoch = list(s.epoch_iter())
    assert len(first_epoch) == 5 and s.state_dict() == {"epoch": 1, "position": 0}
    assert list(s.epoch_iter()) == s.order(1).tolist()


def test_state_from_another_layout_is_refused():
    s = TokenBudgetSampler(10, 0, 2)
    with pytest.raises(ValueError, match="another world size"):
        s.load_state_dict({"epoch": 0, "position": 6})


def test_invalid_sampler_arguments():
    with pytest.raises(ValueError):
        TokenBudgetSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError):
        TokenBudgetSampler(0)


# --------------------------------------------------------------------------- the loader


def test_loader_yields_batches_and_resumes(dataset):
    loader = BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches, 0, 2, seed=5))
    reference = BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches, 0, 2, seed=5))
    expected = [b.index for b in itertools.islice(reference, 7)]
    got = [b.index for b in itertools.islice(loader, 3)]
    state = loader.state_dict()
    fresh = BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches, 0, 2, seed=5))
    fresh.load_state_dict(state)
    got += [b.index for b in itertools.islice(fresh, 4)]
    assert got == expected


def test_loader_epoch_covers_all_rows_across_ranks(dataset):
    rows, tokens = [], 0
    for rank in range(2):
        loader = BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches, rank, 2))
        batches = list(loader.epoch_iter())
        assert len(batches) == 2 and loader.epoch == 1
        for b in batches:
            rows += b.rows.tolist()
            tokens += b.src_tokens
    assert sorted(rows) == RAW_ROWS
    assert tokens == sum(len(s) + 1 for s, _ in PAIRS)


def test_loader_rejects_a_mismatched_sampler(dataset):
    with pytest.raises(ValueError, match="batches"):
        BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches + 1))


def batch_key(b: Batch) -> tuple:
    return (b.index, b.src.tolist(), b.tgt_in.tolist(), b.tgt_out.tolist(), b.rows.tolist(),
            b.tgt_positions.tolist())


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_prefetching_yields_the_plain_loaders_batches_and_resumes_at_the_same_cursor(
        dataset, rank, world):
    def plain() -> BatchLoader:
        return BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches, rank, world, seed=3))

    expected = [batch_key(b) for b in itertools.islice(plain(), 11)]  # several epochs
    ahead = PrefetchLoader(plain(), depth=3)
    it = iter(ahead)
    got = [batch_key(next(it)) for _ in range(4)]
    # The thread has read ahead by now, yet the cursor is that of the 4 batches handed out.
    reference = plain()
    list(itertools.islice(reference, 4))
    assert ahead.state_dict() == reference.state_dict()
    state = ahead.state_dict()
    ahead.close()
    resumed = PrefetchLoader(plain())
    resumed.load_state_dict(state)
    got += [batch_key(b) for b in itertools.islice(resumed, 7)]
    resumed.close()
    assert got == expected


def test_prefetching_reports_the_errors_of_its_thread(dataset, monkeypatch):
    loader = PrefetchLoader(BatchLoader(dataset, TokenBudgetSampler(dataset.num_batches)))
    calls = {"n": 0}
    real = dataset.batch

    def failing(index, resegment=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise DataError("shard-00000.src.npy: truncated")
        return real(index, resegment)

    monkeypatch.setattr(dataset, "batch", failing)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(DataError, match="truncated"):
        next(it)
    with pytest.raises(RuntimeError, match="after iteration has started"):
        loader.load_state_dict({"epoch": 0, "position": 0})
    loader.close()
