"""average: the last training checkpoints → one averaged, self-contained model folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer

from aiayn.errors import DataError
from aiayn.io import check_output_path, file_sha256, write_json
from aiayn.model import Transformer, TransformerConfig
from aiayn.tracking import RUN_FILE, load_run_id
from aiayn.training.checkpoint import (
    average_checkpoints,
    checkpoint_step,
    export_model,
    list_checkpoints,
    load_checkpoint,
)
from stages.common import ParamsPath, log, read_params, single_command_app, stage

META_KEYS = ("model_config", "vocab_size", "tokenizer_sha256")


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
    how, candidates = p.train.average, sorted(set(p.train.average_candidates))
    found = list_checkpoints(checkpoints)
    if not found:
        raise DataError(f"no checkpoints in {checkpoints}; run `aiayn train`")
    # Every average this stage may take is drawn from the largest choice: check it once.
    pool, metas = _choose(found, max(candidates or [p.train.average_last]), how, checkpoints)
    newest_path, newest = pool[-1], metas[pool[-1]]
    for path in pool:
        for key in META_KEYS:
            if metas[path][key] != newest[key]:
                raise DataError(
                    f"{path} and {newest_path} differ in {key} ({metas[path][key]!r} vs "
                    f"{newest[key]!r}): they come from different training runs; delete the "
                    f"stale checkpoints from {checkpoints} or re-run `aiayn train`")

    if not tokenizer.is_file():
        raise DataError(f"{tokenizer}: no tokenizer; run the vocab stage first (`aiayn vocab`)")
    sha = file_sha256(tokenizer)
    if sha != newest["tokenizer_sha256"]:
        raise DataError(
            f"{tokenizer}: sha256 {sha[:12]}… differs from the {newest['tokenizer_sha256'][:12]}… "
            f"the checkpoints in {checkpoints} were trained with: the vocabulary changed since "
            "training; re-run training (`aiayn train`)")

    # The exported folder must load into the model it claims to be: check before writing.
    model = _model(newest, newest_path)
    scores: dict[int, float] = {}
    if candidates:
        wanted, scores = _pick(p, candidates, found, how, checkpoints, raw, tokenizer, model,
                               device)
    else:
        wanted = p.train.average_last
    chosen, _ = _choose(found, wanted, how, checkpoints)
    if len(chosen) < wanted and not candidates:
        log.warning("average: train.average_last is %d but %s holds only %d %scheckpoint(s); "
                    "averaging those %d", wanted, checkpoints, len(chosen),
                    "scored " if how == "best" else "", len(chosen))

    steps = [int(metas[path].get("step", checkpoint_step(path))) for path in chosen]
    bleu = [metas[path].get("valid_bleu") for path in chosen]
    log.info("average: averaging %d checkpoint(s) (%s), steps %s%s", len(chosen), how, steps,
             f", validation sacreBLEU {[round(b, 2) for b in bleu]}" if how == "best" else "")
    weights = average_checkpoints(chosen, key="model")
    _load(model, weights, newest_path)

    config = {
        "model": newest["model_config"],
        "vocab_size": newest["vocab_size"],
        "tokenizer_sha256": newest["tokenizer_sha256"],
        "mlflow_run_id": load_run_id(checkpoints / RUN_FILE),
        "average": how,
        "averaged_steps": steps,
        "averaged_valid_bleu": bleu,
        "average_candidates_valid_bleu": {str(n): score for n, score in scores.items()},
        "tokens_seen": newest.get("tokens_seen"),
    }
    summary = {"average": how, "averaged": len(chosen), "first_step": steps[0],
               "last_step": steps[-1],
               "candidates": {str(n): round(score, 4) for n, score in scores.items()},
               **({"candidates_beam": p.train.valid_bleu_beam} if scores else {})}
    export_model(out, weights, config, extra_files={"tokenizer.json": tokenizer})
    write_json(metrics, summary)
    log.info("average: wrote %s (steps %s)", out, steps)
    if mlflow:
        from aiayn.tracking import log_into_run

        tags = {"average": how, "averaged_steps": ",".join(map(str, steps))}
        if candidates:
            tags["average_candidates"] = ",".join(map(str, candidates))
        log_into_run(checkpoints / RUN_FILE, "average",
                     {"averaged_checkpoints": len(chosen),
                      **{f"average/valid_bleu_{how}_{n}": s for n, s in scores.items()}},
                     [(out, "model"), (metrics, "metrics")], tags=tags,
                     params=p.model_dump(mode="json"))


def _pick(p, candidates: list[int], found: list[Path], how: str, folder: Path, raw: Path,
          tokenizer: Path, model: Transformer, device: str) -> tuple[int, dict[int, float]]:
    """The candidate count whose average decodes the valid split best, and every score."""
    from aiayn.data.tokenizer import load_tokenizer
    from aiayn.decoding.translation import ValidationBleu, decode_device
    from aiayn.precision import autocast_dtype

    scorer = ValidationBleu.from_params(p, raw, load_tokenizer(tokenizer))
    dev = decode_device(device)
    model.to(dev)
    amp = autocast_dtype("auto", dev)
    log.info("average: choosing among %s checkpoints on %d valid sentences (beam %d, %s)",
             candidates, len(scorer.sources), scorer.beam.beam,
             "fp32" if amp is None else str(amp).removeprefix("torch."))
    scores: dict[int, float] = {}
    seen: dict[tuple[Path, ...], int] = {}
    for n in candidates:
        chosen, _ = _choose(found, n, how, folder)
        if tuple(chosen) in seen:  # fewer checkpoints exist than n: the same average
            log.info("average: %s %d: only %d checkpoint(s), the same as %d", how, n,
                     len(chosen), seen[tuple(chosen)])
            continue
        seen[tuple(chosen)] = n
        _load(model, average_checkpoints(chosen, key="model"), chosen[-1])
        started = time.perf_counter()
        scores[n] = scorer(model, dev, amp)
        log.info("average: %s %d → valid sacreBLEU %.2f (%.0f s)", how, n, scores[n],
                 time.perf_counter() - started)
    best = max(scores, key=lambda n: (scores[n], n))
    log.info("average: keeping %s %d (valid sacreBLEU %.2f)", how, best, scores[best])
    model.to("cpu")
    return best, scores


def _model(meta: dict, path: Path) -> Transformer:
    try:
        return Transformer(TransformerConfig(**meta["model_config"]))
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: its recorded model configuration is not valid "
                        f"({str(exc)[:300]}); re-run `aiayn train`") from None


def _load(model: Transformer, weights: dict, path: Path) -> None:
    try:
        model.load_state_dict(weights, strict=True)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"{path}: the averaged weights do not fit the recorded model "
                        f"configuration ({str(exc)[:300]}); re-run `aiayn train`") from None


def _choose(found: list[Path], wanted: int, how: str, folder: Path
            ) -> tuple[list[Path], dict[Path, dict]]:
    """The checkpoints ``how`` picks (at most ``wanted``, in step order) and their metas."""
    if how == "best":
        return _best(found, wanted, folder)
    chosen = found[-wanted:]
    return chosen, {path: _meta(path) for path in chosen}


def _best(found: list[Path], wanted: int, folder: Path) -> tuple[list[Path], dict[Path, dict]]:
    """The ``wanted`` checkpoints with the best validation BLEU (of equals, the later), in
    step order, with their metas."""
    metas = {path: _meta(path) for path in found}
    scored = [path for path in found if metas[path].get("valid_bleu") is not None]
    if not scored:
        raise DataError(
            f"train.average is 'best' but none of the {len(found)} checkpoints in {folder} "
            "has a validation BLEU; train with train.valid_bleu_every set (a multiple of "
            "train.checkpoint_every_steps), or set train.average: last")
    best = sorted(scored, key=lambda path: (metas[path]["valid_bleu"], checkpoint_step(path)),
                  reverse=True)[:wanted]
    chosen = sorted(best, key=checkpoint_step)
    return chosen, {path: metas[path] for path in chosen}


def _meta(path: Path) -> dict:
    """The `meta` dict of a checkpoint, read without loading its tensors into memory."""
    state = load_checkpoint(path, mmap=True)
    meta = state.get("meta")
    if not isinstance(meta, dict) or any(key not in meta for key in META_KEYS):
        raise DataError(f"{path}: no `meta` with {', '.join(META_KEYS)}; this checkpoint was "
                        "not written by `aiayn train`")
    # With every field, defaults included: a run resumed across a version that added a
    # model setting (model.output_vocab) holds checkpoints written without it and with it.
    try:
        meta["model_config"] = TransformerConfig(**meta["model_config"]).to_dict()
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: its model_config does not describe a model this version "
                        f"builds ({exc}); average it with the version that trained it") from None
    return meta


app = single_command_app(average, "Average the last (or best) checkpoints into one exported model.")

if __name__ == "__main__":
    app()
