"""survey: encode every pair once → data/survey/ (lengths, token ids), stats and a histogram."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from tqdm import tqdm

from aiayn.config import SPLITS
from aiayn.data.corpus import raw_rows
from aiayn.data.survey import build_survey, check_raw, histogram, plot_histogram, summarize
from aiayn.io import atomic_path, check_output_path, write_json
from stages.common import ParamsPath, log, read_params, single_command_app, stage


@stage
def survey(
    params: ParamsPath = Path("params.yaml"),
    raw: Annotated[Path, typer.Option(help="Folder of raw splits from `aiayn download`.")] = Path("data/raw"),
    tokenizer: Annotated[Path, typer.Option(help="Tokenizer from `aiayn vocab`.")] = Path("data/vocab/tokenizer.json"),
    out: Annotated[Path, typer.Option(help="Survey folder: per-pair token lengths and the token ids (replaced whole).")] = Path("data/survey"),
    metrics: Annotated[Path, typer.Option(help="Percentiles and drops per candidate max length.")] = Path("metrics/survey.json"),
    plot_data: Annotated[Path, typer.Option(help="Histogram table for `dvc plots`.")] = Path("metrics/survey_hist.csv"),
    plot_image: Annotated[Path, typer.Option(help="Histogram image.")] = Path("metrics/survey_hist.png"),
) -> None:
    """Encode every sentence of every split once: BPE lengths and token ids.

    Reads: params `data.src_lang`/`tgt_lang`, `survey.*`; RAW and TOKENIZER. Writes: OUT/
    with lengths.parquet (columns split, row, one token count per language; the shard
    stage plans its batches from it), ids/{split}.{lang}.npy (the BPE ids of the split's
    sentences, concatenated in row order; the shard stage packs them without encoding
    again) and meta.json (vocabulary size, dtype, rows, tokenizer sha256); METRICS
    (percentiles per split and language; for each length in `survey.max_len_candidates`,
    how many train pairs a `shard.max_len` of that value would drop), and the train-split
    length histogram as PLOT_DATA (CSV) and PLOT_IMAGE (PNG). OUT is replaced only when
    every split succeeded.
    """
    p = read_params(params)
    check_output_path(out, directory=True)
    for path in (metrics, plot_data, plot_image):
        check_output_path(path)
    langs = list(p.data.languages)
    check_raw(raw, langs)
    total = sum(raw_rows(raw, split) for split in SPLITS)
    with tqdm(total=total, desc="survey", unit=" pairs", unit_scale=True, mininterval=1.0) as bar:
        df = build_survey(tokenizer, raw, langs, out, progress=bar.update)
    summary = summarize(df, langs, p.survey.max_len_candidates)
    # Columns named by role, not language, so dvc.yaml's plot works for every pair.
    hist = histogram(df, langs, p.survey.bins).rename(
        columns={p.data.src_lang: "source", p.data.tgt_lang: "target"})
    with atomic_path(plot_data) as tmp:
        hist.to_csv(tmp, index=False)
    plot_histogram(hist, ["source", "target"], plot_image,
                   f"train split: {summary['splits']['train']['pairs']} pairs",
                   labels=[f"{p.data.src_lang} (source)", f"{p.data.tgt_lang} (target)"])
    write_json(metrics, summary)
    train = summary["splits"]["train"]
    log.info("survey: train p99 tokens %s; max_len drops %s",
             {lang: train[lang]["p99"] for lang in langs},
             {k: v["pairs"] for k, v in summary["max_len_drops"].items()})


app = single_command_app(survey, "Survey token lengths.")

if __name__ == "__main__":
    app()
