"""shard: survey (lengths + token ids) → token-budget batches in data/shards/{split}/ + metrics/shard.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from aiayn.data.shards import build_shards, check_inputs
from aiayn.io import check_output_path, write_json
from stages.common import ParamsPath, log, read_params, single_command_app, stage


@stage
def shard(
    params: ParamsPath = Path("params.yaml"),
    vocab: Annotated[Path, typer.Option(help="Tokenizer from `aiayn vocab` (the one the survey used; sets the vocabulary size).")] = Path("data/vocab/tokenizer.json"),
    survey: Annotated[Path, typer.Option(help="Survey folder from `aiayn survey`: lengths to plan batches from, token ids to pack.")] = Path("data/survey"),
    out: Annotated[Path, typer.Option(help="Folder of shards, one subfolder per split (replaced whole).")] = Path("data/shards"),
    metrics: Annotated[Path, typer.Option(help="Pairs, drops, batches, tokens and padding ratio per split.")] = Path("metrics/shard.json"),
) -> None:
    """Pack every split into length-bucketed, token-budget batches on memory-mapped shards.

    Reads: params `data.src_lang`/`tgt_lang` and `shard.*`; SURVEY (lengths.parquet,
    ids/{split}.{lang}.npy, meta.json: no text is encoded again) and VOCAB, which must be
    the tokenizer the survey used. Pairs with a side over `shard.max_len` BPE tokens are
    dropped. The rest are sorted by (source, target) length and cut into batches of at most
    `shard.max_tokens` tokens per side, padding included, then into shards of at most
    `shard.shard_tokens` tokens.

    Writes: OUT/{split}/ with meta.json, batches.npy (shard, start row, end row per batch),
    rows.npy (raw row of each stored pair) and per shard the flat source (ids + EOS) and
    target (BOS + ids + EOS) token arrays with their offsets; METRICS. OUT is replaced only
    when every split succeeded.
    """
    p = read_params(params)
    check_output_path(out, directory=True)
    check_output_path(metrics)
    languages = p.data.languages
    meta = check_inputs(survey, vocab, languages)
    total = sum(entry["rows"] for entry in meta["splits"].values())
    with tqdm(total=total, desc="shard", unit=" pairs", unit_scale=True, mininterval=1.0) as bar:
        stats = build_shards(survey, vocab, out, p.shard, *languages,
                             progress=lambda split, n: bar.update(n))
    summary = {
        "languages": list(languages),
        "max_tokens": p.shard.max_tokens,
        "max_len": p.shard.max_len,
        "shard_tokens": p.shard.shard_tokens,
        "splits": stats,
    }
    write_json(metrics, summary)
    for split, st in stats.items():
        log.info("shard %s: %d pairs (%d over max_len dropped) in %d batches, %d shard(s); "
                 "padding %.1f%%", split, st["pairs"], st["dropped_over_max_len"],
                 st["batches"], st["shards"], 100 * st["padding_ratio"])


app = single_command_app(shard, "Pack the surveyed corpus into token-budget batches on shards.")

if __name__ == "__main__":
    app()
