"""Token-budget batches, planned from lengths and stored as memory-mapped shards.

The paper (Section 5.1) batches sentence pairs "by approximate sequence length" so that each
batch holds about 25000 source and 25000 target tokens. We plan every batch before writing
anything, from the BPE lengths the survey stage measured:

1. drop pairs with a side longer than ``max_len`` tokens (counted);
2. sort the rest by (source length, target length), stable, so the plan is deterministic;
3. cut the sorted pairs greedily into batches with ``pairs * longest <= max_tokens`` on each
   side, padding included (a pair costs ``len + 1`` per side: source + EOS, target shifted);
4. cut the batch sequence into shards of at most ``shard_tokens`` stored tokens, at batch
   boundaries only, so a batch is a contiguous row range of one shard.

No tokenizer runs here: the survey stage kept the BPE ids of every sentence in flat files
(:mod:`aiayn.data.survey`). They are memory-mapped, and the stored pairs are gathered from them
shard by shard in stored order, a chunk of pairs at a time (vectorised index arithmetic),
with EOS appended to the source and BOS/EOS put around the target, and written as
contiguous slices of ``numpy`` memory maps. Memory stays bounded: only per-pair integers
(lengths, permutation, offsets) and one chunk of ids live in RAM, never all token ids. The
tokenizer file is only read for its vocabulary size, and must be the one the survey used.

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

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from numpy.lib.format import open_memmap

from aiayn.config import SPLITS, ShardConfig
from aiayn.data import survey
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_tokenizer
from aiayn.errors import DataError
from aiayn.io import atomic_path, file_sha256, read_json, write_json

FORMAT = "aiayn-shards"
FORMAT_VERSION = 1
SRC_EXTRA = 1  # stored source = ids + [EOS]
TGT_EXTRA = 2  # stored target = [BOS] + ids + [EOS]; decoder sees len + 1 on each of in/out
# Beside the splits: the tokenizer the shards' ids come from (its sha256), so that training
# refuses shards of another tokenizer of the same size. Outside the splits' files on purpose:
# a run's identity hashes those (aiayn.training.run_store.run_identity), and a new file there would
# set aside every run made before it.
SOURCE_FILE = "source.json"
# Pairs gathered per step: a few MB of ids and index arrays (build_shards' fill_chunk).
FILL_CHUNK = 100_000


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


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


def _stale(path: Path, what: str) -> DataError:
    return DataError(f"{path}: {what}; the survey is stale or damaged, re-run `aiayn survey`")


def check_inputs(survey_dir: Path, tokenizer: Path, languages: tuple[str, str],
                 splits: tuple[str, ...] = SPLITS) -> dict:
    """Fail before any work if the survey is missing, incomplete or was made with another
    tokenizer or other languages. Returns the survey's meta.json."""
    survey_dir, tokenizer = Path(survey_dir), Path(tokenizer)
    meta_path = survey_dir / survey.META_FILE
    if not meta_path.is_file():
        raise DataError(f"{meta_path}: missing; run the survey stage first (`aiayn survey`)")
    try:
        meta = read_json(meta_path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _stale(meta_path, f"not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != survey.FORMAT \
            or meta.get("format_version") != survey.FORMAT_VERSION:
        raise _stale(meta_path, f"not a {survey.FORMAT!r} version {survey.FORMAT_VERSION} "
                                "meta file")
    missing = [lang for lang in languages if lang not in meta.get("languages", [])]
    if missing:
        raise DataError(
            f"{meta_path}: no language {', '.join(map(repr, missing))} surveyed (languages: "
            f"{', '.join(meta.get('languages', []))}); re-run `aiayn survey` with the current "
            "data.src_lang/data.tgt_lang"
        )
    vocab_size = load_tokenizer(tokenizer).get_vocab_size()
    sha = file_sha256(tokenizer)
    if meta.get("vocab_size") != vocab_size or meta.get("tokenizer_sha256") != sha:
        raise DataError(
            f"{meta_path}: the survey's token ids were made with a tokenizer of "
            f"{meta.get('vocab_size')} tokens (sha256 {str(meta.get('tokenizer_sha256'))[:12]}), "
            f"but {tokenizer} has {vocab_size} tokens (sha256 {sha[:12]}); the survey belongs "
            "to another tokenizer, re-run `aiayn survey` with this one"
        )
    if meta.get("dtype") != survey.token_dtype(vocab_size).name:
        raise _stale(meta_path, f"field 'dtype' is {meta.get('dtype')!r}, expected "
                                f"{survey.token_dtype(vocab_size).name!r}")
    lengths = survey_dir / survey.LENGTHS_FILE
    if not lengths.is_file():
        raise _stale(lengths, "missing")
    try:
        names = pq.read_schema(lengths).names
    except (pa.ArrowException, OSError) as exc:
        raise _stale(lengths, f"not a parquet file ({exc})") from None
    absent = [c for c in ("split", "row", *languages) if c not in names]
    if absent:
        raise _stale(lengths, f"no column(s) {', '.join(absent)} (columns: {', '.join(names)})")
    for split in splits:
        if not isinstance(meta.get("splits", {}).get(split, {}).get("rows"), int):
            raise _stale(meta_path, f"no row count for split {split!r}")
        for lang in languages:
            path = survey.ids_path(survey_dir, split, lang)
            if not path.is_file():
                raise _stale(path, "missing")
    return meta


def read_lengths(survey_dir: Path, split: str, src_lang: str, tgt_lang: str,
                 expected_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Survey lengths of one split, checked to cover rows 0..n-1 in order (n from meta)."""
    lengths = Path(survey_dir) / survey.LENGTHS_FILE
    table = pq.read_table(lengths, columns=["split", "row", src_lang, tgt_lang])
    # The survey stores `split` as a pandas category (a dictionary column): compare as text.
    table = table.filter(pc.equal(table["split"].cast(pa.string()), split))
    rows = table["row"].to_numpy()
    if rows.size != expected_rows or not np.array_equal(rows, np.arange(expected_rows)):
        raise _stale(lengths, f"field 'row' of split {split!r} covers {rows.size} rows but "
                              f"{survey.META_FILE} says {expected_rows} (rows 0..n-1 in order "
                              "expected)")
    src = table[src_lang].to_numpy().astype(np.int64)
    tgt = table[tgt_lang].to_numpy().astype(np.int64)
    return src, tgt


def load_ids(survey_dir: Path, split: str, lang: str, lengths: np.ndarray,
             dtype: np.dtype) -> np.ndarray:
    """The flat ids of one split and language, memory-mapped, checked against the lengths."""
    path = survey.ids_path(survey_dir, split, lang)
    try:
        flat = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise _stale(path, f"cannot be read ({exc})") from None
    if flat.ndim != 1 or flat.dtype != dtype:
        raise _stale(path, f"holds {flat.dtype} {flat.shape}, expected 1-D {dtype.name}")
    total = int(lengths.sum())
    if flat.size != total:
        raise _stale(path, f"holds {flat.size} token ids but column {lang!r} of split "
                           f"{split!r} of {survey.LENGTHS_FILE} sums to {total}")
    return flat


# --------------------------------------------------------------------------- writing


@dataclass
class _Layout:
    """Per shard, where each stored pair starts in the shard's flat arrays."""

    src_offsets: list[np.ndarray]  # per shard, int64 [rows + 1]
    tgt_offsets: list[np.ndarray]


def _layout(plan: Plan) -> _Layout:
    pair_bounds = plan.pair_bounds_of_shards()
    src_offsets, tgt_offsets = [], []
    for k in range(plan.num_shards):
        lo, hi = pair_bounds[k], pair_bounds[k + 1]
        src_offsets.append(survey.sentence_offsets(plan.src_len[lo:hi] + SRC_EXTRA))
        tgt_offsets.append(survey.sentence_offsets(plan.tgt_len[lo:hi] + TGT_EXTRA))
    return _Layout(src_offsets, tgt_offsets)


def gather(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray, bos: bool,
           dtype: np.dtype) -> np.ndarray:
    """Sequences ``flat[starts[j]:starts[j] + lens[j]]`` concatenated with specials:
    ``[BOS]? + ids + [EOS]`` each, as one flat array of ``dtype``."""
    stored = lens + (2 if bos else 1)
    ends = np.cumsum(stored)  # exclusive end of each stored sequence
    out = np.empty(int(ends[-1]) if ends.size else 0, dtype=dtype)
    is_id = np.ones(out.size, dtype=bool)
    is_id[ends - 1] = False
    if bos:
        is_id[ends - stored] = False
    # Token t of the concatenated ids belongs to sequence j: it sits at flat[t + shift[j]].
    run_starts = np.cumsum(lens) - lens
    index = np.repeat(starts - run_starts, lens)
    index += np.arange(index.size, dtype=np.int64)
    out[is_id] = flat[index]  # a boolean mask keeps order: ids land between the specials
    out[ends - 1] = EOS_ID
    if bos:
        out[ends - stored] = BOS_ID
    return out


def build_split(survey_dir: Path, meta: dict, split: str, out_dir: Path, cfg: ShardConfig,
                src_lang: str, tgt_lang: str,
                progress: Callable[[int], None] | None = None,
                fill_chunk: int = FILL_CHUNK) -> dict:
    """Plan, gather and write one split into the (fresh) folder ``out_dir``; return metrics.

    ``meta`` is the survey's meta.json as :func:`check_inputs` returned it. ``progress`` is
    called with the number of survey rows just handled (dropped pairs count at the end).
    ``fill_chunk``: pairs gathered at once (any size writes the same bytes).
    """
    survey_dir = Path(survey_dir)
    src_len, tgt_len = read_lengths(survey_dir, split, src_lang, tgt_lang,
                                    meta["splits"][split]["rows"])
    n_rows = src_len.size
    plan = plan_split(src_len, tgt_len, cfg.max_tokens, cfg.max_len, cfg.shard_tokens)
    if plan.num_pairs == 0:
        raise DataError(
            f"{survey_dir / survey.LENGTHS_FILE}: every one of the {n_rows} pairs of split "
            f"{split!r} has a side longer than shard.max_len = {cfg.max_len} tokens; raise "
            "shard.max_len in params.yaml"
        )
    vocab_size = int(meta["vocab_size"])
    dtype = survey.token_dtype(vocab_size)
    sides = []
    for lang, lengths, stored_len, bos in ((src_lang, src_len, plan.src_len, False),
                                           (tgt_lang, tgt_len, plan.tgt_len, True)):
        flat = load_ids(survey_dir, split, lang, lengths, dtype)
        sides.append((lang, flat, survey.sentence_offsets(lengths)[:-1], stored_len, bos))
    layout = _layout(plan)

    out_dir.mkdir(parents=True, exist_ok=True)
    pair_bounds = plan.pair_bounds_of_shards()
    for k in range(plan.num_shards):
        name = shard_name(k)
        arrays = [open_memmap(out_dir / f"{name}.{part}.npy", mode="w+", dtype=dtype,
                              shape=(int(offsets[k][-1]),))
                  for part, offsets in (("src", layout.src_offsets),
                                        ("tgt", layout.tgt_offsets))]
        p0, p1 = int(pair_bounds[k]), int(pair_bounds[k + 1])
        for lo in range(p0, p1, fill_chunk):  # stored order: each chunk is one slice
            hi = min(lo + fill_chunk, p1)
            rows = plan.order[lo:hi]
            for (lang, flat, starts, stored_len, bos), arr, offsets in zip(
                    sides, arrays, (layout.src_offsets[k], layout.tgt_offsets[k]),
                    strict=True):
                packed = gather(flat, starts[rows], stored_len[lo:hi], bos, dtype)
                top = int(packed.max())
                if top >= vocab_size:
                    raise _stale(survey.ids_path(survey_dir, split, lang),
                                 f"holds token id {top}, over the vocabulary of {vocab_size}")
                arr[offsets[lo - p0]:offsets[hi - p0]] = packed
            if progress:
                progress(hi - lo)
        for arr in arrays:
            arr.flush()
        del arrays
    if progress and plan.dropped:
        progress(plan.dropped)

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


def build_shards(survey_dir: str | Path, tokenizer: str | Path, out: str | Path,
                 cfg: ShardConfig, src_lang: str, tgt_lang: str,
                 splits: tuple[str, ...] = SPLITS,
                 progress: Callable[[str, int], None] | None = None,
                 fill_chunk: int = FILL_CHUNK) -> dict[str, dict]:
    """Build ``out/{split}/`` for every split from the survey folder ``survey_dir``; ``out``
    is replaced whole, only on success.

    ``tokenizer`` is the tokenizer file: its vocabulary size sets the dtype, and it must be
    the one the survey encoded with. ``progress`` is called with (split, rows just handled);
    ``fill_chunk``: pairs gathered at once. Returns metrics per split.
    """
    survey_dir, out = Path(survey_dir), Path(out)
    meta = check_inputs(survey_dir, Path(tokenizer), (src_lang, tgt_lang), splits)
    metrics: dict[str, dict] = {}
    with atomic_path(out, directory=True) as tmp:
        for split in splits:
            report = (lambda n, s=split: progress(s, n)) if progress else None
            metrics[split] = build_split(survey_dir, meta, split, tmp / split, cfg,
                                         src_lang, tgt_lang, report, fill_chunk)
        write_json(tmp / SOURCE_FILE, {"tokenizer_sha256": meta["tokenizer_sha256"],
                                       "vocab_size": meta["vocab_size"]})
    return metrics


def check_tokenizer(shards: str | Path, tokenizer_sha256: str) -> None:
    """Refuse shards built with another tokenizer than the one of ``tokenizer_sha256`` (the
    sha256 that ``SOURCE_FILE`` records; shards from before it was written pass)."""
    path = Path(shards) / SOURCE_FILE
    if not path.is_file():
        return
    try:
        recorded = read_json(path).get("tokenizer_sha256")
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{path}: not readable ({exc}); re-run `aiayn shard`") from None
    if recorded != tokenizer_sha256:
        raise DataError(
            f"{path}: the shards hold the token ids of the tokenizer of sha256 "
            f"{str(recorded)[:12]}…, but training was given the one of sha256 "
            f"{tokenizer_sha256[:12]}… (the vocabulary changed since); re-run `aiayn survey` "
            "and `aiayn shard` (or `dvc repro`)")
