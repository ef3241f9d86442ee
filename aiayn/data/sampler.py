"""Reading the shards back: padded batches, and which batch each rank takes next.

The shard stage stored the pairs sorted by length with a plan of batches (:mod:`aiayn.data.shards`);
:class:`ShardDataset` reads that plan, or cuts its own from the same sorted pairs for another
token budget (:mod:`aiayn.data.batching`: training plans its micro-batches for the step and the
number of processes when it starts). :class:`TokenBudgetSampler` shuffles batch indices per
epoch from ``(seed, epoch)`` with its own numpy generator (never torch's global RNG, so model
code cannot disturb the data order), deals them round-robin to the ranks, and keeps a
two-integer cursor so that a resumed run sees exactly the batches an uninterrupted run would
have seen.

Every rank gets the same number of items per epoch so that DDP ranks stay in lockstep; when
the batches do not divide evenly, the ranks left over in the last round get ``-1``, an empty
batch that contributes no tokens (:meth:`Batch.empty`).
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiayn.data import batching
from aiayn.data.shards import FORMAT, FORMAT_VERSION
from aiayn.data.subword import SubwordSplitter
from aiayn.errors import DataError

EMPTY = -1  # the batch index of an empty batch
SIDES = ("src", "tgt")

# (flat tokens, lengths, side) -> (flat tokens, lengths): a rewrite of a batch's sequences.
Resegment = Callable[[np.ndarray, np.ndarray, str], tuple[np.ndarray, np.ndarray]]

_META_KEYS = ("split", "src_lang", "tgt_lang", "vocab_size", "dtype", "pad_id", "bos_id",
              "eos_id", "num_pairs", "num_batches", "shards")


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """A padded batch of pairs; tensors are int64 (``torch.long``).

    ``src`` [B, S] is source + EOS; ``tgt_in`` [B, T] is BOS + target (decoder input);
    ``tgt_out`` [B, T] is target + EOS (labels). Padding is ``pad_id`` on every tensor.
    ``rows`` [B] are the raw row indices of the pairs, ``src_tokens``/``tgt_tokens`` the
    non-pad counts of ``src``/``tgt_out`` (what a token-normalised loss divides by).
    ``tgt_positions`` [tgt_tokens] are the flat (row-major) positions of the non-pad labels,
    which are also the real positions of ``tgt_in``: the rows a decoder that skips padding
    computes (``aiayn.fast.Packing``). The loader finds them on the host, so that a GPU
    never has to be asked how many there are.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    rows: torch.Tensor
    src_tokens: int
    tgt_tokens: int
    index: int = EMPTY  # batch index in the split, EMPTY for an empty batch
    tgt_positions: torch.Tensor | None = None

    @classmethod
    def empty(cls, pad_id: int = 0) -> Batch:
        """A batch of 0 pairs. Sequence dimensions are 1, not 0, so that shape-generic model
        code (masks, softmax) never meets a zero-length axis; there are no elements anyway."""
        blank = torch.full((0, 1), pad_id, dtype=torch.long)
        none = torch.zeros(0, dtype=torch.long)
        return cls(blank, blank.clone(), blank.clone(), none, 0, 0, EMPTY, none.clone())

    @property
    def num_pairs(self) -> int:
        return int(self.src.shape[0])

    def __len__(self) -> int:
        return self.num_pairs

    @property
    def is_empty(self) -> bool:
        return self.num_pairs == 0

    def _map(self, fn) -> Batch:
        positions = None if self.tgt_positions is None else fn(self.tgt_positions)
        return Batch(fn(self.src), fn(self.tgt_in), fn(self.tgt_out), fn(self.rows),
                     self.src_tokens, self.tgt_tokens, self.index, positions)

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def pad_rows(flat: np.ndarray, lengths: np.ndarray, pad_id: int) -> np.ndarray:
    """Lay consecutive sequences of ``flat`` out as rows of a [B, max length] int64 array."""
    width = int(lengths.max()) if lengths.size else 1
    out = np.full((lengths.size, width), pad_id, dtype=np.int64)
    # Row-major order of this mask is exactly the order of the tokens in `flat`.
    out[np.arange(width) < lengths[:, None]] = flat
    return out


# --------------------------------------------------------------------------- dataset


def _meta_error(path: Path, what: str) -> DataError:
    return DataError(f"{path}: {what}; re-run the shard stage (`aiayn shard`)")


def read_meta(folder: Path) -> dict:
    """meta.json of a split folder, checked for format and required fields."""
    path = folder / "meta.json"
    if not path.is_file():
        raise _meta_error(path, "missing (not a shard folder, or an interrupted build)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _meta_error(path, f"not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _meta_error(path, f"field 'format' is not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _meta_error(path, f"field 'format_version' is {meta.get('format_version')!r}, "
                                f"this code reads version {FORMAT_VERSION}")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise _meta_error(path, f"missing field(s) {', '.join(missing)}")
    return meta


class ShardDataset:
    """One split of shards, memory-mapped read-only: ``batch(i)`` builds padded tensors.

    ``max_tokens`` None: the shard stage's batches (``batches.npy``, cut at its
    ``shard.max_tokens``); a number: batches of at most that many tokens per side, padding
    included, cut from the same length-sorted pairs when the dataset opens
    (:func:`aiayn.data.batching.plan_stored_batches`; a second or so for WMT14's 4.5M pairs).
    ``max_tokens`` says which budget the batches follow.

    Opening costs a few file handles; pages are read when a batch touches them, so many
    processes (DDP ranks, loader workers) can share one copy in the page cache.
    """

    def __init__(self, path: str | Path, max_tokens: int | None = None):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.pad_id = int(self.meta["pad_id"])
        stored = self._load("batches.npy", ndim=2)
        self.rows = self._load("rows.npy", ndim=1)
        if stored.shape != (self.meta["num_batches"], 3):
            raise _meta_error(self.path / "batches.npy",
                              f"shape {stored.shape}, meta.json says "
                              f"({self.meta['num_batches']}, 3)")
        if self.rows.shape != (self.meta["num_pairs"],):
            raise _meta_error(self.path / "rows.npy", f"{self.rows.size} rows, meta.json says "
                                                       f"{self.meta['num_pairs']}")
        self.shards = [self._open_shard(s) for s in self.meta["shards"]]
        # the shard stage's budget (None in a folder written without it)
        self.batches, self.max_tokens = stored, self.meta.get("max_tokens")
        self.planned = False
        if max_tokens is not None:
            self.replan(max_tokens)

    def replan(self, max_tokens: int) -> None:
        """Take batches of at most ``max_tokens`` tokens per side from now on, cut from the
        stored pairs (ValueError when the longest pair does not fit)."""
        longest = self.longest_pair()
        if max_tokens < longest:
            raise ValueError(f"{self.path}: batches of {max_tokens} tokens cannot hold its "
                             f"longest pair ({longest} tokens on one side)")
        self.batches = self.plan_batches(max_tokens)
        self.max_tokens, self.planned = int(max_tokens), True

    def plan_batches(self, max_tokens: int) -> np.ndarray:
        """Batches of at most ``max_tokens`` tokens per side over this split's stored pairs:
        int64 [num_batches, 3] of (shard, start row, end row), as ``batches.npy``."""
        return batching.plan_stored_batches(self._offsets(), max_tokens)

    def _offsets(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(s["src_offsets"], s["tgt_offsets"]) for s in self.shards]

    def target_tokens(self) -> int:
        """The target tokens (labels: target + EOS) of every pair of the split."""
        return sum(int(batching.pair_costs(a, b)[1].sum()) for a, b in self._offsets())

    def longest_pair(self) -> int:
        """The most tokens one pair takes in a batch on either side: the smallest batch
        budget that holds every pair of the split."""
        return batching.longest_pair(self._offsets())

    def _load(self, name: str, ndim: int) -> np.ndarray:
        path = self.path / name
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise _meta_error(path, f"cannot be read ({exc})") from None
        if arr.ndim != ndim:
            raise _meta_error(path, f"has {arr.ndim} dimensions, expected {ndim}")
        return arr

    def _open_shard(self, entry: dict) -> dict:
        name = entry["name"]
        arrays = {part: self._load(f"{name}.{part}.npy", ndim=1)
                  for part in ("src", "tgt", "src_offsets", "tgt_offsets")}
        arrays["first_pair"] = int(entry["first_pair"])
        for side in ("src", "tgt"):
            if arrays[f"{side}_offsets"][-1] != arrays[side].size:
                raise _meta_error(self.path / f"{name}.{side}.npy", "size disagrees with its "
                                                                     "offsets (truncated?)")
        return arrays

    def __getstate__(self) -> dict:
        # Pickled for a loader worker or another process: reopen the maps there instead of
        # copying every token array into the pickle.
        return {"path": self.path, "max_tokens": self.max_tokens if self.planned else None}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state.get("max_tokens"))

    @property
    def num_batches(self) -> int:
        return int(self.batches.shape[0])

    @property
    def num_pairs(self) -> int:
        return int(self.meta["num_pairs"])

    def __len__(self) -> int:
        return self.num_batches

    def token_counts(self, side: str) -> np.ndarray:
        """How often each token id occurs on ``side`` ("src": source + EOS; "tgt": BOS +
        target + EOS) over the whole split: int64 [vocab_size]."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, not {side!r}")
        counts = np.zeros(int(self.meta["vocab_size"]), dtype=np.int64)
        for shard in self.shards:
            tokens = shard[side]
            for lo in range(0, tokens.size, 1 << 24):  # bounded memory on large shards
                counts += np.bincount(tokens[lo:lo + (1 << 24)], minlength=counts.size)
        return counts

    def batch(self, index: int, resegment: Resegment | None = None) -> Batch:
        """Batch ``index`` as padded tensors; ``EMPTY`` (-1) gives a 0-pair batch.

        ``resegment(flat, lengths, side)`` may rewrite the token sequences of each side
        (``"src"``: source + EOS, ``"tgt"``: BOS + target + EOS) before they are padded,
        e.g. :class:`aiayn.data.subword.SubwordSplitter`.
        """
        if index == EMPTY:
            return Batch.empty(self.pad_id)
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range 0..{self.num_batches - 1}")
        shard_id, start, end = (int(v) for v in self.batches[index])
        shard = self.shards[shard_id]
        src, src_len = self._sequences(shard, "src", start, end)
        tgt, tgt_len = self._sequences(shard, "tgt", start, end)
        if resegment is not None:
            src, src_len = resegment(src, src_len, "src")
            tgt, tgt_len = resegment(tgt, tgt_len, "tgt")
        full = pad_rows(tgt, tgt_len, self.pad_id)  # [B, T+1]: BOS ... EOS
        tgt_out = full[:, 1:]
        # Decoder input drops each row's last real token (its EOS), not just the last column.
        tgt_in = np.where(np.arange(full.shape[1] - 1) < (tgt_len - 1)[:, None], full[:, :-1],
                          self.pad_id)
        first = shard["first_pair"]
        return Batch(
            src=torch.from_numpy(pad_rows(src, src_len, self.pad_id)),
            tgt_in=torch.from_numpy(np.ascontiguousarray(tgt_in)),
            tgt_out=torch.from_numpy(np.ascontiguousarray(tgt_out)),
            rows=torch.from_numpy(np.array(self.rows[first + start:first + end], np.int64)),
            src_tokens=int(src_len.sum()),
            tgt_tokens=int((tgt_len - 1).sum()),
            index=index,
            tgt_positions=torch.from_numpy(np.flatnonzero(tgt_out != self.pad_id)),
        )

    @staticmethod
    def _sequences(shard: dict, side: str, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.asarray(shard[f"{side}_offsets"][start:end + 1], dtype=np.int64)
        flat = np.asarray(shard[side][offsets[0]:offsets[-1]], dtype=np.int64)
        return flat, np.diff(offsets)


# --------------------------------------------------------------------------- sampling


class TokenBudgetSampler:
    """Batch indices for one rank: each epoch a fresh permutation, dealt round-robin.

    Epoch ``e`` shuffles all batches with ``np.random.default_rng([seed, e])`` (identity
    order with ``shuffle=False``) and pads the order with ``EMPTY`` to a multiple of
    ``world_size``; rank ``r`` takes positions ``r, r + N, r + 2N, ...``. So within an epoch
    the ranks' batches are disjoint and together cover every batch once, and every rank
    yields ``per_rank = ceil(num_batches / world_size)`` items.

    The sampler is its own iterator over an endless stream (the epoch advances by itself);
    :meth:`epoch_iter` yields what is left of the current epoch only. The cursor
    (``epoch``, ``position`` = items already taken this epoch) is all the state there is.
    """

    def __init__(self, num_batches: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 epoch: int = 0, shuffle: bool = True):
        if num_batches <= 0:
            raise ValueError(f"num_batches must be positive, not {num_batches}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, not {epoch}")
        self.num_batches = num_batches
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = epoch
        self.position = 0
        self._order: np.ndarray | None = None  # this rank's order for self.epoch, cached

    @property
    def per_rank(self) -> int:
        return -(-self.num_batches // self.world_size)

    def order(self, epoch: int) -> np.ndarray:
        """All of this rank's batch indices of ``epoch`` (``EMPTY`` for a missing batch)."""
        if self.shuffle:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_batches)
        else:
            perm = np.arange(self.num_batches)
        padded = np.full(self.per_rank * self.world_size, EMPTY, dtype=np.int64)
        padded[:self.num_batches] = perm
        return padded[self.rank::self.world_size]

    def _current(self) -> np.ndarray:
        if self._order is None:
            self._order = self.order(self.epoch)
        return self._order

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = None

    def __iter__(self) -> TokenBudgetSampler:
        return self

    def __next__(self) -> int:
        if self.position >= self.per_rank:
            self._advance_epoch()
        index = int(self._current()[self.position])
        self.position += 1
        return index

    def epoch_iter(self) -> Iterator[int]:
        """The rest of the current epoch; afterwards the cursor stands at the next epoch."""
        if self.position >= self.per_rank:
            self._advance_epoch()
        while self.position < self.per_rank:
            yield next(self)
        self._advance_epoch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.per_rank:
            raise ValueError(f"sampler state {state} does not fit {self.per_rank} batches "
                             "per rank (was it saved with another world size or shard build?)")
        self.epoch, self.position, self._order = epoch, position, None


class BatchLoader:
    """Sampler + dataset: an endless stream of :class:`Batch` for one rank.

    ``state_dict`` is the sampler's cursor, taken after the last batch handed out, so a
    checkpoint saved after step k resumes at the batch of step k + 1.
    """

    def __init__(self, dataset: ShardDataset, sampler: TokenBudgetSampler,
                 pin_memory: bool = False, splitter: SubwordSplitter | None = None):
        if sampler.num_batches != dataset.num_batches:
            raise ValueError(f"sampler has {sampler.num_batches} batches, dataset "
                             f"{dataset.path} has {dataset.num_batches}")
        self.dataset = dataset
        self.sampler = sampler
        self.pin_memory = pin_memory
        self.splitter = splitter

    def build(self, index: int, epoch: int) -> Batch:
        """Batch ``index`` as epoch ``epoch`` sees it (the splitter's draws depend on both)."""
        resegment = None
        if self.splitter is not None:
            def resegment(flat, lengths, side):
                return self.splitter(flat, lengths, (epoch, index, SIDES.index(side)))
        return self.dataset.batch(index, resegment)

    def _load(self, index: int) -> Batch:
        batch = self.build(index, self.sampler.epoch)
        return batch.pin_memory() if self.pin_memory else batch

    def __iter__(self) -> Iterator[Batch]:
        for index in self.sampler:
            yield self._load(index)

    def epoch_iter(self) -> Iterator[Batch]:
        """The batches left in the current epoch (e.g. one validation pass)."""
        for index in self.sampler.epoch_iter():
            yield self._load(index)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class PrefetchLoader:
    """A :class:`BatchLoader` read ahead by a background thread: the next ``depth`` batches
    are built (and, for a GPU, pinned) while the current step computes.

    It yields exactly the batches of the loader it wraps, in the same order. Its
    ``state_dict`` is the cursor after the last batch *handed out*, not after the last one
    read ahead, so a checkpoint resumes at the batch the next step would have taken.
    ``load_state_dict`` must come before the first batch is asked for.
    """

    def __init__(self, loader: BatchLoader, depth: int = 2, pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.loader, self.depth, self.pin_memory = loader, depth, pin_memory
        self._state = loader.state_dict()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _produce(self) -> None:
        sampler = self.loader.sampler
        try:
            for index in sampler:
                batch = self.loader.build(index, sampler.epoch)
                if self.pin_memory:
                    batch = batch.pin_memory()
                item = (batch, sampler.state_dict())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put((None, exc))

    def __iter__(self) -> Iterator[Batch]:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(target=self._produce, name="aiayn-prefetch",
                                            daemon=True)
            self._thread.start()
        while True:
            batch, state = self._queue.get()
            if batch is None:
                raise state
            self._state = state
            yield batch

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("PrefetchLoader.load_state_dict after iteration has started")
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()

    def close(self) -> None:
        """Stop the reading thread (it is a daemon, so an exiting process never waits)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
