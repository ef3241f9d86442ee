"""average: the last training checkpoints → one averaged, self-contained model folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer

from aiayn.io import check_output_path, write_json
from aiayn.tracking import RUN_FILE
from aiayn.training.averaging import RunCheckpoints, load_weights
from aiayn.training.checkpoint import average_checkpoints
from stages.common import ParamsPath, log, read_params, single_command_app, stage


@stage
def average(
    params: ParamsPath = Path("params.yaml"),
    checkpoints: Annotated[Path, typer.Option(help="Folder of step-*.pt checkpoints written by `aiayn train`.")] = Path("data/checkpoints"),
    tokenizer: Annotated[Path, typer.Option(help="The tokenizer the checkpoints were trained with; copied into OUT.")] = Path("data/vocab/tokenizer.json"),
    out: Annotated[Path, typer.Option(help="Model folder written: model.safetensors, config.json, tokenizer.json.")] = Path("data/model"),
    raw: Annotated[Path, typer.Option(help="Folder of the download stage's parquet files; its valid split scores the candidates of train.average_candidates (not read without them).")] = Path("data/raw"),
    metrics: Annotated[Path, typer.Option(help="JSON written: how many checkpoints were averaged, their steps, and each candidate's validation BLEU.")] = Path("metrics/average.json"),
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="Where candidates are decoded: auto (cuda if a GPU is visible), cpu or cuda.")] = "auto",
    mlflow: Annotated[bool, typer.Option(help="Upload OUT into the training run's MLflow artifacts (model/); the run id is CHECKPOINTS/mlflow_run.json.")] = True,
) -> None:
    """Average the weights of checkpoints into one model (paper Section 6.1).

    Reads: params `train.average_last` (how many) and `train.average`: `last` takes the last
    that many CHECKPOINTS (the paper), `best` the that many with the best validation BLEU
    (recorded by training with `train.valid_bleu_every`); fewer, with a warning, if fewer
    exist. They must share one model configuration and tokenizer hash. TOKENIZER, whose
    sha256 must equal the one recorded at training time.
    With `train.average_candidates` (e.g. [1, 3, 5, 10]) the count is chosen instead: each
    candidate's average translates the valid split in RAW (as `train.valid_bleu_sentences`,
    `_beam` and `_alpha` say, with bf16 where the hardware has it natively), and the one
    with the best sacreBLEU is kept (of equals, the larger count).
    Writes: OUT as one atomic folder: model.safetensors (the element-wise mean of the
    model weights), config.json (model configuration, vocabulary size, tokenizer sha256,
    MLflow run id, how the checkpoints were chosen, the averaged steps and their validation
    BLEU, each candidate's score, tokens seen) and tokenizer.json (a copy of TOKENIZER), so
    that the folder alone suffices to translate. METRICS (a DVC metric). With MLflow on, OUT
    is also uploaded into the training run's artifacts (under model/), with the choice as
    tags and the candidates' scores as metrics.
    """
    p = read_params(params)
    check_output_path(out, directory=True)
    check_output_path(metrics)
    candidates = sorted(set(p.train.average_candidates))
    # Every average this stage may take is drawn from the largest choice: check it once.
    run = RunCheckpoints.open(checkpoints, tokenizer, max(candidates or [p.train.average_last]),
                              p.train.average)
    scores: dict[int, float] = {}
    if candidates:
        wanted, scores = _pick(p, candidates, run, raw, device)
    else:
        wanted = p.train.average_last
    config = run.write(out, wanted, candidate_scores=scores)
    how, steps = run.how, config["averaged_steps"]
    summary = {"average": how, "averaged": len(steps), "first_step": steps[0],
               "last_step": steps[-1],
               "candidates": {str(n): round(score, 4) for n, score in scores.items()},
               **({"candidates_beam": p.train.valid_bleu_beam} if scores else {})}
    write_json(metrics, summary)
    log.info("average: wrote %s (steps %s)", out, steps)
    if mlflow:
        from aiayn.tracking import log_into_run

        tags = {"average": how, "averaged_steps": ",".join(map(str, steps))}
        if candidates:
            tags["average_candidates"] = ",".join(map(str, candidates))
        log_into_run(checkpoints / RUN_FILE, "average",
                     {"averaged_checkpoints": len(steps),
                      **{f"average/valid_bleu_{how}_{n}": s for n, s in scores.items()}},
                     [(out, "model"), (metrics, "metrics")], tags=tags,
                     params=p.model_dump(mode="json"))


def _pick(p, candidates: list[int], run: RunCheckpoints, raw: Path, device: str
          ) -> tuple[int, dict[int, float]]:
    """The candidate count whose average decodes the valid split best, and every score."""
    from aiayn.data.tokenizer import load_tokenizer
    from aiayn.decoding.translation import ValidationBleu, decode_device
    from aiayn.precision import autocast_dtype

    scorer = ValidationBleu.from_params(p, raw, load_tokenizer(run.tokenizer))
    dev = decode_device(device)
    model = run.model.to(dev)
    amp = autocast_dtype("auto", dev)
    log.info("average: choosing among %s checkpoints on %d valid sentences (beam %d, %s)",
             candidates, len(scorer.sources), scorer.beam.beam,
             "fp32" if amp is None else str(amp).removeprefix("torch."))
    scores: dict[int, float] = {}
    seen: dict[tuple[Path, ...], int] = {}
    for n in candidates:
        chosen, _ = run.choose(n)
        if tuple(chosen) in seen:  # fewer checkpoints exist than n: the same average
            log.info("average: %s %d: only %d checkpoint(s), the same as %d", run.how, n,
                     len(chosen), seen[tuple(chosen)])
            continue
        seen[tuple(chosen)] = n
        load_weights(model, average_checkpoints(chosen, key="model"), chosen[-1])
        started = time.perf_counter()
        scores[n] = scorer(model, dev, amp)
        log.info("average: %s %d → valid sacreBLEU %.2f (%.0f s)", run.how, n, scores[n],
                 time.perf_counter() - started)
    best = max(scores, key=lambda n: (scores[n], n))
    log.info("average: keeping %s %d (valid sacreBLEU %.2f)", run.how, best, scores[best])
    model.to("cpu")
    return best, scores


app = single_command_app(average, "Average the last (or best) checkpoints into one exported model.")

if __name__ == "__main__":
    app()
