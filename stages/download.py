"""download: raw parallel text → data/raw/{train,valid,test}.parquet + metrics/download.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from aiayn.data.corpus import make_source, write_raw_splits
from aiayn.io import check_output_path, write_json
from stages.common import ParamsPath, log, read_params, single_command_app, stage


@stage
def download(
    params: ParamsPath = Path("params.yaml"),
    out: Annotated[Path, typer.Option(help="Folder for the cleaned splits (replaced whole).")] = Path("data/raw"),
    metrics: Annotated[Path, typer.Option(help="Counts of pairs kept and dropped, by reason.")] = Path("metrics/download.json"),
) -> None:
    """Fetch and clean the parallel corpus named by `data.*` in params.yaml.

    Sources (`data.source`): `hub` streams a Hugging Face dataset (default wmt/wmt14 de-en:
    train, newstest2013 as valid, newstest2014 as test); `local` reads line-aligned text files
    (`data.local.dir`, `data.local.pattern`); `toy` generates the built-in synthetic task.

    Reads: params `data.*` and the source. Writes: OUT/{train,valid,test}.parquet, one string
    column per language, and METRICS. Train pairs are stripped and filtered by
    `data.clean` (empty, too many words, length ratio); valid/test only lose empty pairs
    unless `data.clean.clean_test` is set. OUT is replaced only when all splits succeed.
    """
    p = read_params(params)
    check_output_path(out, directory=True)
    check_output_path(metrics)
    source = make_source(p.data, root=params.resolve().parent)
    log.info("download: %s, languages %s", source.describe(), "+".join(p.data.languages))
    bars: dict[str, tqdm] = {}

    def progress(split: str, read: int) -> None:
        bar = bars.get(split)
        if bar is None:
            bar = bars[split] = tqdm(desc=f"download {split}", unit=" pairs", unit_scale=True,
                                     mininterval=1.0)
        bar.update(read - bar.n)

    try:
        stats = write_raw_splits(source, p.data.languages, p.data.clean, out, progress)
    finally:
        for bar in bars.values():
            bar.close()
    summary = {
        "source": source.describe(),
        "languages": list(p.data.languages),
        "splits": {split: st.as_dict() for split, st in stats.items()},
    }
    write_json(metrics, summary)
    for split, st in stats.items():
        log.info("download %s: kept %d of %d (dropped %s)", split, st.kept, st.read,
                 dict(st.dropped) or "none")


app = single_command_app(download, "Fetch and clean the parallel corpus.")

if __name__ == "__main__":
    app()
