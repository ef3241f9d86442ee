"""average: the last training checkpoints → one averaged, self-contained model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aiayn.checkpoint import (
    average_checkpoints,
    checkpoint_step,
    export_model,
    file_sha256,
    list_checkpoints,
    load_checkpoint,
)
from aiayn.errors import DataError
from aiayn.model import Transformer, TransformerConfig
from stages.common import ParamsPath, log, read_params, single_command_app, stage

META_KEYS = ("model_config", "vocab_size", "tokenizer_sha256")


@stage
def average(
    params: ParamsPath = Path("params.yaml"),
    checkpoints: Annotated[Path, typer.Option(help="Folder of step-*.pt checkpoints written by `aiayn train`.")] = Path("data/checkpoints"),
    tokenizer: Annotated[Path, typer.Option(help="The tokenizer the checkpoints were trained with; copied into OUT.")] = Path("data/vocab/tokenizer.json"),
    out: Annotated[Path, typer.Option(help="Model folder written: model.safetensors, config.json, tokenizer.json.")] = Path("data/model"),
    mlflow: Annotated[bool, typer.Option(help="Upload OUT into the training run's MLflow artifacts (model/); the run id is CHECKPOINTS/mlflow_run.json.")] = True,
) -> None:
    """Average the weights of checkpoints into one model (paper Section 6.1).

    Reads: params `train.average_last` (how many) and `train.average`: `last` takes the last
    that many CHECKPOINTS (the paper), `best` the that many with the best validation BLEU
    (recorded by training with `train.valid_bleu_every`); fewer, with a warning, if fewer
    exist. They must share one model configuration and tokenizer hash. TOKENIZER, whose
    sha256 must equal the one recorded at training time.
    Writes: OUT as one atomic folder: model.safetensors (the element-wise mean of the
    model weights), config.json (model configuration, vocabulary size, tokenizer sha256,
    MLflow run id, how the checkpoints were chosen, the averaged steps and their validation
    BLEU, tokens seen) and tokenizer.json (a copy of TOKENIZER), so that the folder alone
    suffices to translate. With MLflow on, OUT is also uploaded into the training run's
    artifacts (under model/), with the choice as tags.
    """
    p = read_params(params)
    wanted, how = p.train.average_last, p.train.average
    found = list_checkpoints(checkpoints)
    if not found:
        raise DataError(f"no checkpoints in {checkpoints}; run `aiayn train`")
    if how == "best":
        chosen, metas = _best(found, wanted, checkpoints)
    else:
        chosen = found[-wanted:]
        metas = [_meta(path) for path in chosen]
    if len(chosen) < wanted:
        log.warning("average: train.average_last is %d but %s holds only %d %scheckpoint(s); "
                    "averaging those %d", wanted, checkpoints, len(chosen),
                    "scored " if how == "best" else "", len(chosen))

    newest_path, newest = chosen[-1], metas[-1]
    for path, meta in zip(chosen, metas, strict=True):
        for key in META_KEYS:
            if meta[key] != newest[key]:
                raise DataError(
                    f"{path} and {newest_path} differ in {key} ({meta[key]!r} vs "
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

    steps = [int(meta.get("step", checkpoint_step(path))) for path, meta in zip(chosen, metas, strict=True)]
    bleu = [meta.get("valid_bleu") for meta in metas]
    log.info("average: averaging %d checkpoint(s) (%s), steps %s%s", len(chosen), how, steps,
             f", validation sacreBLEU {[round(b, 2) for b in bleu]}" if how == "best" else "")
    weights = average_checkpoints(chosen, key="model")

    # The exported folder must load into the model it claims to be: check before writing.
    try:
        cfg = TransformerConfig(**newest["model_config"])
        Transformer(cfg).load_state_dict(weights, strict=True)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"{newest_path}: the averaged weights do not fit the recorded model "
                        f"configuration ({str(exc)[:300]}); re-run `aiayn train`") from None

    config = {
        "model": newest["model_config"],
        "vocab_size": newest["vocab_size"],
        "tokenizer_sha256": newest["tokenizer_sha256"],
        "mlflow_run_id": newest.get("mlflow_run_id"),
        "average": how,
        "averaged_steps": steps,
        "averaged_valid_bleu": bleu,
        "tokens_seen": newest.get("tokens_seen"),
    }
    export_model(out, weights, config, extra_files={"tokenizer.json": tokenizer})
    log.info("average: wrote %s (steps %s)", out, steps)
    if mlflow:
        from aiayn.tracking import log_into_run

        log_into_run(checkpoints / "mlflow_run.json", "average",
                     {"averaged_checkpoints": len(chosen)}, [(out, "model")],
                     tags={"average": how, "averaged_steps": ",".join(map(str, steps))},
                     params=p.model_dump(mode="json"))


def _best(found: list[Path], wanted: int, folder: Path) -> tuple[list[Path], list[dict]]:
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
    return chosen, [metas[path] for path in chosen]


def _meta(path: Path) -> dict:
    """The `meta` dict of a checkpoint, read without loading its tensors into memory."""
    state = load_checkpoint(path, mmap=True)
    meta = state.get("meta")
    if not isinstance(meta, dict) or any(key not in meta for key in META_KEYS):
        raise DataError(f"{path}: no `meta` with {', '.join(META_KEYS)}; this checkpoint was "
                        "not written by `aiayn train`")
    return meta


app = single_command_app(average, "Average the last (or best) checkpoints into one exported model.")

if __name__ == "__main__":
    app()
