"""Token-budget batches, planned from lengths and stored as memory-mapped shards.

The paper (Section 5.1) batches sentence pairs "by approximate sequence length" so that each
batch holds about 25000 source and 25000 target tokens. We plan every batch before encoding
anything, from the BPE lengths the survey stage measured:

1. drop pairs with a side longer than ``max_len`` tokens (counted);
2. sort the rest by (source length, target length), stable, so the plan is deterministic;
3. cut the sorted pairs greedily into batches with ``pairs * longest <= max_tokens`` on each
   side, padding included (a pair costs ``len + 1`` per side: source + EOS, target shifted);
4. cut the batch sequence into shards of at most ``shard_tokens`` stored tokens, at batch
   boundaries only, so a batch is a contiguous row range of one shard.

Then the raw text is streamed once in its original order, encoded in chunks, and every pair
is scattered straight to its sorted position in ``numpy`` memory maps. Memory stays bounded:
only per-pair integers (lengths, permutation, offsets) live in RAM, never all token ids.

Layout of ``{out}/{split}/`` (format version :data:`FORMAT_VERSION`)::

    meta.json                     what is below, and the parameters it was built with
    batches.npy                   int64 [num_batches, 3]: shard, start_row, end_row
    rows.npy                      int64 [num_pairs]: raw row of each pair, in stored order
    shard-00000.src.npy           flat source ids, each pair ids + [EOS]
    shard-00000.tgt.npy           flat target ids, each pair [BOS] + ids + [EOS]
    shard-00000.src_offsets.npy   int64 [rows + 1]: pair r is src[off[r]:off[r + 1]]
    shard-00000.tgt_offsets.npy   int64 [rows + 1]
    ...

Row r of shard k is pair ``meta["shards"][k]["first_pair"] + r`` of ``rows.npy``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from numpy.lib.format import open_memmap
from tokenizers import Tokenizer

from aiayn.config import SPLITS, ShardConfig
from aiayn.corpus import iter_raw, raw_path
from aiayn.errors import DataError
from aiayn.io import atomic_path, write_json
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode_ids

FORMAT = "aiayn-shards"
FORMAT_VERSION = 1
SRC_EXTRA = 1  # stored source = ids + [EOS]
TGT_EXTRA = 2  # stored target = [BOS] + ids + [EOS]; decoder sees len + 1 on each of in/out
ENCODE_CHUNK = 20_000  # raw rows encoded per call: bounded memory, parallel encoding


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id (uint16 halves disk and page cache)."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Plan:
    """Where every kept pair goes, decided from lengths alone.

    Positions ``p`` index the kept pairs in stored (sorted) order.
    """

    order: np.ndarray  # int64 [n]: input index (raw row) of the pair at position p
    src_len: np.ndarray  # int64 [n]: BPE length without specials, in stored order
    tgt_len: np.ndarray  # int64 [n]
    batch_bounds: np.ndarray  # int64 [num_batches + 1]: batch b is positions [b_i, b_i+1)
    shard_bounds: np.ndarray  # int64 [num_shards + 1]: shard k is batches [s_k, s_k+1)
    dropped: int  # pairs with a side over max_len

    @property
    def num_pairs(self) -> int:
        return int(self.order.size)

    @property
    def num_batches(self) -> int:
        return int(self.batch_bounds.size - 1)

    @property
    def num_shards(self) -> int:
        return int(self.shard_bounds.size - 1)

    def pair_bounds_of_shards(self) -> np.ndarray:
        """[num_shards + 1] positions: shard k holds pairs [p_k, p_k+1)."""
        return self.batch_bounds[self.shard_bounds]


def plan_split(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, max_len: int,
               shard_tokens: int) -> Plan:
    """Filter, sort and cut one split; see the module docstring for the rules."""
    src_len = np.asarray(src_len, dtype=np.int64)
    tgt_len = np.asarray(tgt_len, dtype=np.int64)
    if src_len.shape != tgt_len.shape or src_len.ndim != 1:
        raise ValueError("src_len and tgt_len must be 1-D arrays of the same length")
    if max_len + max(SRC_EXTRA, TGT_EXTRA - 1) > max_tokens:
        raise ValueError(f"max_len {max_len} cannot fit in a batch of max_tokens {max_tokens}")
    kept = np.flatnonzero((src_len <= max_len) & (tgt_len <= max_len))
    # lexsort is stable and sorts by the last key first: (source, target), ties by raw row.
    order = kept[np.lexsort((tgt_len[kept], src_len[kept]))]
    s, t = src_len[order], tgt_len[order]
    batch_bounds = cut_batches(s + SRC_EXTRA, t + TGT_EXTRA - 1, max_tokens)
    stored = s + SRC_EXTRA + t + TGT_EXTRA
    shard_bounds = cut_shards(batch_token_sums(stored, batch_bounds), shard_tokens)
    return Plan(order=order, src_len=s, tgt_len=t, batch_bounds=batch_bounds,
                shard_bounds=shard_bounds, dropped=int(src_len.size - kept.size))


def cut_batches(src_cost: np.ndarray, tgt_cost: np.ndarray, max_tokens: int) -> np.ndarray:
    """Greedy cut of sorted pairs: extend a batch while pairs x longest fits on both sides.

    Returns batch boundaries ``[0, ..., n]``. Sorted input keeps the padding small; greedy
    is optimal for the number of batches given the order.
    """
    bounds = [0]
    count = longest_src = longest_tgt = 0
    for i, (s, t) in enumerate(zip(src_cost.tolist(), tgt_cost.tolist(), strict=True)):
        if s > max_tokens or t > max_tokens:
            raise ValueError(f"pair {i} ({s}, {t} tokens) exceeds max_tokens {max_tokens}")
        ls, lt = max(longest_src, s), max(longest_tgt, t)
        if count and ((count + 1) * ls > max_tokens or (count + 1) * lt > max_tokens):
            bounds.append(i)
            count, longest_src, longest_tgt = 1, s, t
        else:
            count, longest_src, longest_tgt = count + 1, ls, lt
    if count:
        bounds.append(len(src_cost))
    return np.asarray(bounds, dtype=np.int64)


def batch_token_sums(per_pair: np.ndarray, batch_bounds: np.ndarray) -> np.ndarray:
    """Sum of a per-pair quantity over each batch."""
    if batch_bounds.size < 2:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(np.asarray(per_pair, dtype=np.int64), batch_bounds[:-1])


def cut_shards(batch_tokens: np.ndarray, shard_tokens: int) -> np.ndarray:
    """Greedy cut of the batch sequence into shards of at most ``shard_tokens`` tokens.

    A batch bigger than ``shard_tokens`` on its own still gets a shard (batches never split).
    Returns shard boundaries in batch indices ``[0, ..., num_batches]``.
    """
    bounds = [0]
    total = 0
    for b, tokens in enumerate(batch_tokens.tolist()):
        if total and total + tokens > shard_tokens:
            bounds.append(b)
            total = 0
        total += tokens
    if total:
        bounds.append(len(batch_tokens))
    return np.asarray(bounds, dtype=np.int64)


def padding_stats(plan: Plan) -> dict:
    """Tokens the model sees per side (len + 1) and the padding the batches add."""
    src_cost = plan.src_len + SRC_EXTRA
    tgt_cost = plan.tgt_len + TGT_EXTRA - 1
    bounds = plan.batch_bounds
    if plan.num_batches == 0:
        sizes = np.zeros(0, dtype=np.int64)
        slots = 0
    else:
        sizes = np.diff(bounds)
        longest_src = np.maximum.reduceat(src_cost, bounds[:-1])
        longest_tgt = np.maximum.reduceat(tgt_cost, bounds[:-1])
        slots = int((sizes * longest_src).sum() + (sizes * longest_tgt).sum())
    real = int(src_cost.sum() + tgt_cost.sum())
    return {
        "source_tokens": int(src_cost.sum()),
        "target_tokens": int(tgt_cost.sum()),
        "padding_tokens": slots - real,
        "padding_ratio": (slots - real) / slots if slots else 0.0,
        "mean_pairs_per_batch": float(sizes.mean()) if sizes.size else 0.0,
    }


# --------------------------------------------------------------------------- inputs


def check_inputs(raw_dir: Path, lengths: Path, languages: tuple[str, str],
                 splits: tuple[str, ...] = SPLITS) -> None:
    """Fail before any work if a raw split, a language column or the survey is missing."""
    for split in splits:
        path = raw_path(raw_dir, split)
        if not path.is_file():
            raise DataError(f"{path}: missing; run the download stage first (`aiayn download`)")
        names = pq.read_schema(path).names
        for lang in languages:
            if lang not in names:
                raise DataError(
                    f"{path}: no column {lang!r} (columns: {', '.join(names)}); "
                    "data.src_lang/data.tgt_lang in params.yaml must name languages of the "
                    "downloaded corpus, or re-run `aiayn download` after changing them"
                )
    if not lengths.is_file():
        raise DataError(f"{lengths}: missing; run the survey stage first (`aiayn survey`)")
    try:
        names = pq.read_schema(lengths).names
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{lengths}: not a parquet file ({exc}); re-run `aiayn survey`") from None
    missing = [c for c in ("split", "row", *languages) if c not in names]
    if missing:
        raise DataError(
            f"{lengths}: no column(s) {', '.join(missing)} (columns: {', '.join(names)}); "
            "re-run `aiayn survey` with the current data.src_lang/data.tgt_lang"
        )


def read_lengths(lengths: Path, split: str, src_lang: str, tgt_lang: str,
                 raw_file: Path) -> tuple[np.ndarray, np.ndarray]:
    """Survey lengths of one split, checked to cover the raw file's rows 0..n-1 in order."""
    expected_rows = pq.ParquetFile(raw_file).metadata.num_rows
    table = pq.read_table(lengths, columns=["split", "row", src_lang, tgt_lang])
    # The survey stores `split` as a pandas category (a dictionary column): compare as text.
    table = table.filter(pc.equal(table["split"].cast(pa.string()), split))
    rows = table["row"].to_numpy()
    if rows.size != expected_rows or not np.array_equal(rows, np.arange(expected_rows)):
        raise DataError(
            f"{lengths}: field 'row' of split {split!r} covers {rows.size} rows but "
            f"{raw_file} has {expected_rows} (rows 0..n-1 in order expected); "
            "lengths.parquet is stale, re-run `aiayn survey`"
        )
    src = table[src_lang].to_numpy().astype(np.int64)
    tgt = table[tgt_lang].to_numpy().astype(np.int64)
    return src, tgt


# --------------------------------------------------------------------------- writing


@dataclass
class _Layout:
    """Per-position destination: which shard and where in its flat arrays."""

    shard: np.ndarray  # int64 [n]
    src_start: np.ndarray  # int64 [n], within the shard
    tgt_start: np.ndarray
    src_offsets: list[np.ndarray]  # per shard, [rows + 1]
    tgt_offsets: list[np.ndarray]


def _layout(plan: Plan) -> _Layout:
    pair_bounds = plan.pair_bounds_of_shards()
    shard = np.repeat(np.arange(plan.num_shards, dtype=np.int64), np.diff(pair_bounds))
    src_stored = plan.src_len + SRC_EXTRA
    tgt_stored = plan.tgt_len + TGT_EXTRA
    src_start = np.empty(plan.num_pairs, dtype=np.int64)
    tgt_start = np.empty(plan.num_pairs, dtype=np.int64)
    src_offsets, tgt_offsets = [], []
    for k in range(plan.num_shards):
        lo, hi = pair_bounds[k], pair_bounds[k + 1]
        for stored, start, offsets in ((src_stored, src_start, src_offsets),
                                       (tgt_stored, tgt_start, tgt_offsets)):
            off = np.zeros(hi - lo + 1, dtype=np.int64)
            np.cumsum(stored[lo:hi], out=off[1:])
            start[lo:hi] = off[:-1]
            offsets.append(off)
    return _Layout(shard, src_start, tgt_start, src_offsets, tgt_offsets)


def pack(ids: list[list[int]], bos: bool, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate sequences with specials: ``[BOS]? + ids + [EOS]`` each.

    Returns the flat array and the stored length of each sequence.
    """
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    extra = 2 if bos else 1
    stored = lens + extra
    starts = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(stored[:-1], out=starts[1:])
    raw_starts = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(lens[:-1], out=raw_starts[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lens.sum()))
    out = np.empty(int(stored.sum()), dtype=dtype)
    shift = np.repeat(starts + (1 if bos else 0) - raw_starts, lens)
    out[np.arange(flat.size) + shift] = flat
    out[starts + stored - 1] = EOS_ID
    if bos:
        out[starts] = BOS_ID
    return out, stored


def scatter(packed: np.ndarray, stored: np.ndarray, shard: np.ndarray, start: np.ndarray,
            arrays: list[np.ndarray]) -> None:
    """Copy packed sequence j to ``arrays[shard[j]][start[j]:start[j] + stored[j]]``."""
    local = np.zeros(stored.size, dtype=np.int64)
    np.cumsum(stored[:-1], out=local[1:])
    dest = np.repeat(start - local, stored) + np.arange(packed.size)
    token_shard = np.repeat(shard, stored)
    for k in np.unique(shard).tolist():
        mask = token_shard == k
        arrays[k][dest[mask]] = packed[mask]


def _stale(lengths: Path, split: str, lang: str, row: int, surveyed: int, encoded: int):
    return DataError(
        f"{lengths}: field {lang!r} of split {split!r}, row {row}, says {surveyed} tokens but "
        f"the tokenizer gives {encoded}; lengths.parquet is stale (made with another tokenizer "
        "or corpus), re-run `aiayn survey`"
    )


def _check_lengths(got: np.ndarray, want: np.ndarray, rows: np.ndarray, lengths: Path,
                   split: str, lang: str, extra: int) -> None:
    bad = np.flatnonzero(got != want + extra)
    if bad.size:
        i = bad[0]
        raise _stale(lengths, split, lang, int(rows[i]), int(want[i]), int(got[i] - extra))


def build_split(raw_dir: Path, split: str, tok: Tokenizer, lengths: Path, out_dir: Path,
                cfg: ShardConfig, src_lang: str, tgt_lang: str,
                progress: Callable[[int], None] | None = None) -> dict:
    """Plan, encode and write one split into the (fresh) folder ``out_dir``; return metrics.

    ``progress`` is called with the number of raw rows just encoded.
    """
    src_len, tgt_len = read_lengths(lengths, split, src_lang, tgt_lang, raw_path(raw_dir, split))
    n_rows = src_len.size
    plan = plan_split(src_len, tgt_len, cfg.max_tokens, cfg.max_len, cfg.shard_tokens)
    if plan.num_pairs == 0:
        raise DataError(
            f"{lengths}: every one of the {n_rows} pairs of split {split!r} has a side longer "
            f"than shard.max_len = {cfg.max_len} tokens; raise shard.max_len in params.yaml"
        )
    vocab_size = tok.get_vocab_size()
    dtype = token_dtype(vocab_size)
    layout = _layout(plan)
    position = np.full(n_rows, -1, dtype=np.int64)
    position[plan.order] = np.arange(plan.num_pairs)

    out_dir.mkdir(parents=True, exist_ok=True)
    src_arrays, tgt_arrays = [], []
    for k in range(plan.num_shards):
        name = shard_name(k)
        src_arrays.append(open_memmap(out_dir / f"{name}.src.npy", mode="w+", dtype=dtype,
                                      shape=(int(layout.src_offsets[k][-1]),)))
        tgt_arrays.append(open_memmap(out_dir / f"{name}.tgt.npy", mode="w+", dtype=dtype,
                                      shape=(int(layout.tgt_offsets[k][-1]),)))

    row0 = 0
    for chunk in iter_raw(raw_dir, split, [src_lang, tgt_lang], batch_size=ENCODE_CHUNK):
        n = len(chunk[src_lang])
        pos = position[row0:row0 + n]
        keep = np.flatnonzero(pos >= 0)
        if keep.size:
            p = pos[keep]
            for lang, bos, want, start, arrays in (
                (src_lang, False, plan.src_len, layout.src_start, src_arrays),
                (tgt_lang, True, plan.tgt_len, layout.tgt_start, tgt_arrays),
            ):
                texts = chunk[lang]
                ids = encode_ids(tok, [texts[i] for i in keep.tolist()])
                packed, stored = pack(ids, bos, dtype)
                _check_lengths(stored, want[p], keep + row0, lengths, split, lang,
                               TGT_EXTRA if bos else SRC_EXTRA)
                scatter(packed, stored, layout.shard[p], start[p], arrays)
        row0 += n
        if progress:
            progress(n)
    if row0 != n_rows:  # the file changed under us
        raise DataError(f"{raw_path(raw_dir, split)}: read {row0} rows, expected {n_rows}")
    for arr in src_arrays + tgt_arrays:
        arr.flush()
    del src_arrays, tgt_arrays

    return _write_index(out_dir, split, plan, layout, cfg, src_lang, tgt_lang, vocab_size,
                        dtype)


def _batches_table(plan: Plan) -> np.ndarray:
    """[num_batches, 3] int64: shard, start_row, end_row (rows relative to the shard)."""
    pair_bounds = plan.pair_bounds_of_shards()
    shard_of_batch = np.repeat(np.arange(plan.num_shards, dtype=np.int64),
                               np.diff(plan.shard_bounds))
    first = pair_bounds[shard_of_batch]
    starts = plan.batch_bounds[:-1] - first
    ends = plan.batch_bounds[1:] - first
    return np.stack([shard_of_batch, starts, ends], axis=1).astype(np.int64)


def _write_index(out_dir: Path, split: str, plan: Plan, layout: _Layout, cfg: ShardConfig,
                 src_lang: str, tgt_lang: str, vocab_size: int, dtype: np.dtype) -> dict:
    pair_bounds = plan.pair_bounds_of_shards()
    shards = []
    for k in range(plan.num_shards):
        name = shard_name(k)
        np.save(out_dir / f"{name}.src_offsets.npy", layout.src_offsets[k])
        np.save(out_dir / f"{name}.tgt_offsets.npy", layout.tgt_offsets[k])
        shards.append({
            "name": name,
            "pairs": int(pair_bounds[k + 1] - pair_bounds[k]),
            "first_pair": int(pair_bounds[k]),
            "batches": int(plan.shard_bounds[k + 1] - plan.shard_bounds[k]),
            "src_tokens": int(layout.src_offsets[k][-1]),
            "tgt_tokens": int(layout.tgt_offsets[k][-1]),
        })
    np.save(out_dir / "batches.npy", _batches_table(plan))
    np.save(out_dir / "rows.npy", plan.order.astype(np.int64))
    stats = padding_stats(plan)
    metrics = {
        "pairs": plan.num_pairs,
        "dropped_over_max_len": plan.dropped,
        "batches": plan.num_batches,
        "shards": plan.num_shards,
        **stats,
    }
    write_json(out_dir / "meta.json", {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "split": split,
        "src_lang": src_lang,
        "tgt_lang": tgt_lang,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "max_tokens": cfg.max_tokens,
        "max_len": cfg.max_len,
        "shard_tokens": cfg.shard_tokens,
        "num_pairs": plan.num_pairs,
        "num_batches": plan.num_batches,
        "dropped_over_max_len": plan.dropped,
        "rows_file": "rows.npy",
        "batches_file": "batches.npy",
        "shards": shards,
        "stats": stats,
    })
    return metrics


def build_shards(raw_dir: str | Path, tok: Tokenizer, lengths: str | Path, out: str | Path,
                 cfg: ShardConfig, src_lang: str, tgt_lang: str,
                 splits: tuple[str, ...] = SPLITS,
                 progress: Callable[[str, int], None] | None = None) -> dict[str, dict]:
    """Build ``out/{split}/`` for every split; ``out`` is replaced whole, only on success.

    ``progress`` is called with (split, raw rows just encoded). Returns metrics per split.
    """
    raw_dir, lengths, out = Path(raw_dir), Path(lengths), Path(out)
    check_inputs(raw_dir, lengths, (src_lang, tgt_lang), splits)
    metrics: dict[str, dict] = {}
    with atomic_path(out, directory=True) as tmp:
        for split in splits:
            report = (lambda n, s=split: progress(s, n)) if progress else None
            metrics[split] = build_split(raw_dir, split, tok, lengths, tmp / split, cfg,
                                         src_lang, tgt_lang, report)
    return metrics
