"""score: detokenized translations + raw references → BLEU and chrF (metrics/bleu.json, MLflow)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aiayn.config import SPLITS
from aiayn.data.corpus import iter_raw, raw_path
from aiayn.errors import AiaynError
from aiayn.io import check_output_path, write_json
from stages.common import ParamsPath, log, read_params, single_command_app, stage

NOTE = (
    "Three BLEUs of the same translations against the same raw references. 'sacrebleu' is "
    "sacreBLEU's standard corpus BLEU (its own 13a tokenization of detokenized text, settings "
    "in the signature): use it to compare honestly with other systems. 'tokenized_bleu' "
    "follows tensor2tensor's get_ende_bleu.sh (Moses tokenization, hyphenated compounds split "
    "into '##AT##-##AT##' tokens, multi-bleu.perl), the procedure behind the paper's 27.3 "
    "(base) / 28.4 (big) BLEU on newstest2014 en-de: compare it only with those numbers. "
    "The two differ because tokenization decides which n-grams exist: the split hyphens add "
    "extra, easily matched tokens, and Moses splits text differently from 13a, so the "
    "tokenized BLEU usually comes out higher. 'lowercase_bleu' is Moses tokenization and "
    "multi-bleu.perl -lc without compound splitting: the scale of the Multi30k literature "
    "(WMT16-18 multimodal tasks and the papers that report on test2016)."
)


def resolve_template(path: Path, src: str, tgt: str, split: str = "test") -> Path:
    """``{tgt}``, ``{src}`` and ``{split}`` in PATH → the language codes and the split."""
    return Path(str(path).replace("{tgt}", tgt).replace("{src}", src).replace("{split}", split))


@stage
def score(
    params: ParamsPath = Path("params.yaml"),
    hypotheses: Annotated[Path, typer.Option(help="Detokenized translations from `aiayn translate`, one line per sentence of SPLIT; {split}, {tgt} and {src} become SPLIT, data.tgt_lang and data.src_lang.")] = Path("data/translations/{split}.{tgt}"),
    raw: Annotated[Path, typer.Option(help="Raw splits from `aiayn download`; the references are the data.tgt_lang column of RAW/SPLIT.parquet, as the corpus gives them.")] = Path("data/raw"),
    split: Annotated[str, typer.Option(help="The split whose references are scored against (train, valid or test).")] = "test",
    metrics: Annotated[Path, typer.Option(help="Scores written (JSON): sacreBLEU BLEU and chrF with signatures, tokenized BLEU, sentences.")] = Path("metrics/bleu.json"),
    run_file: Annotated[Path, typer.Option(help="The MLflow run id saved by `aiayn train`; the scores are logged into that run.")] = Path("data/checkpoints/mlflow_run.json"),
    mlflow: Annotated[bool, typer.Option(help="Log the scores into the training run in MLflow (MLFLOW_TRACKING_URI, default sqlite:///mlflow.db).")] = True,
    mlflow_prefix: Annotated[str | None, typer.Option(help="Prefix of the MLflow metric names (default: 'SPLIT/'; the pipeline scores the final model on valid as 'final_valid/', apart from training's valid/sacrebleu curve).")] = None,
) -> None:
    """Score translations with sacreBLEU (BLEU, chrF) and the paper's tokenized BLEU.

    Reads: params `data.src_lang`/`data.tgt_lang`; HYPOTHESES; the data.tgt_lang column of
    RAW/SPLIT.parquet (the references exactly as the corpus gives them, never re-tokenized).
    Writes: METRICS, atomically: sacreBLEU BLEU (13a, exp smoothing, mixed case) with its
    signature, n-gram precisions, brevity penalty and lengths; chrF2 with its signature;
    tokenized BLEU as tensor2tensor's get_ende_bleu.sh computes it (Moses tokenization,
    compound splitting, multi-bleu.perl; comparable with the paper's 27.3/28.4, not with
    sacreBLEU); lowercased tokenized BLEU (Moses tokenization, multi-bleu.perl -lc: the
    scale of the Multi30k literature); the direction, split, sentence count and a note on
    the BLEUs. Logs PREFIX+sacrebleu, PREFIX+chrf, PREFIX+tokenized_bleu and
    PREFIX+lowercase_bleu (PREFIX: --mlflow-prefix),
    METRICS and HYPOTHESES into the training run's MLflow run (the id in RUN_FILE); skipped
    when there is none or with --no-mlflow.
    """
    from aiayn.decoding.scoring import score_files

    p = read_params(params)
    check_output_path(metrics)
    if split not in SPLITS:
        raise AiaynError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    src, tgt = p.data.src_lang, p.data.tgt_lang
    hyp_path = resolve_template(hypotheses, src, tgt, split)
    references = _references(raw, split, tgt)
    result = score_files(hyp_path, references, tgt,
                         reference_source=f"{raw_path(raw, split)} (column {tgt!r})")
    report = {
        "direction": f"{src}-{tgt}",
        "split": split,
        "hypotheses": str(hyp_path),
        "references": f"{raw_path(raw, split)}:{tgt}",
        **result,
        "note": NOTE,
    }
    write_json(metrics, report)
    _print_table(report)
    if mlflow:
        from aiayn.tracking import log_into_run

        prefix = f"{split}/" if mlflow_prefix is None else mlflow_prefix
        log_into_run(run_file, "score", {
            f"{prefix}sacrebleu": report["sacrebleu"]["score"],
            f"{prefix}chrf": report["chrf"]["score"],
            f"{prefix}tokenized_bleu": report["tokenized_bleu"]["score"],
            f"{prefix}lowercase_bleu": report["lowercase_bleu"]["score"],
        }, [(metrics, "metrics"), (hyp_path, "translations")], params=p.model_dump(mode="json"))
    else:
        log.info("score: --no-mlflow; scores only in %s", metrics)


def _references(raw: Path, split: str, lang: str) -> list[str]:
    # iter_raw names the file for a missing, unreadable or non-text column and a null row.
    return [t for batch in iter_raw(raw, split, columns=[lang]) for t in batch[lang]]


def _print_table(report: dict) -> None:
    rows = [
        ("sacreBLEU", report["sacrebleu"]["score"], report["sacrebleu"]["signature"]),
        ("chrF2", report["chrf"]["score"], report["chrf"]["signature"]),
        ("tokenized BLEU", report["tokenized_bleu"]["score"],
         report["tokenized_bleu"]["procedure"]),
        ("lowercased BLEU", report["lowercase_bleu"]["score"],
         report["lowercase_bleu"]["procedure"]),
    ]
    typer.echo(f"{report['direction']} {report['split']}, {report['sentences']} sentences")
    for name, value, how in rows:
        typer.echo(f"  {name:<15}{value:7.2f}  {how}")


app = single_command_app(score, "Score translations: sacreBLEU BLEU and chrF, tokenized BLEU.")

if __name__ == "__main__":
    app()
