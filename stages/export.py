"""export: the averaged model → a CTranslate2 or a Hugging Face transformers model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from aiayn.io import read_json
from stages.common import ParamsPath, log, read_params, single_command_app, stage

METRICS = ("bleu", "train", "download", "vocab")


@stage
def export(
    fmt: Annotated[Literal["ctranslate2", "transformers"], typer.Option("--format", "-f", help="ctranslate2 (a CTranslate2 model folder, quantizable) or transformers (a MarianMT folder for AutoModelForSeq2SeqLM / AutoTokenizer / pipeline).")],
    params: ParamsPath = Path("params.yaml"),
    model: Annotated[Path, typer.Option(help="Folder from `aiayn average` (model.safetensors, config.json, tokenizer.json).")] = Path("data/model"),
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Folder written, replaced as a whole (default: data/export/FORMAT).")] = None,
    quantization: Annotated[Literal["none", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16"], typer.Option(help="ctranslate2 only: weight type, as CTranslate2 offers (none keeps float32).")] = "none",
    metrics: Annotated[Path, typer.Option(help="Folder of the pipeline's metrics (bleu.json, train.json, download.json, vocab.json) for the model card; missing files are reported as not measured.")] = Path("metrics"),
) -> None:
    """Export the trained model for another inference engine (needs `pip install -e '.[export]'`).

    The exported model computes what `aiayn translate` computes: before the folder is
    renamed into place, the export is loaded back by its engine and must give our per-token
    log-probabilities of a probe translation (within 1e-3; quantized exports are only
    reported). Use it with `aiayn translate --engine FORMAT`, or from Python (README).

    Reads: MODEL; params `data.src_lang`/`tgt_lang` (the model card) and `decode.beam`/
    `decode.alpha` (the transformers generation defaults); METRICS/{bleu,train,download,vocab}.json
    if present. Writes: OUT, atomically (a temporary folder renamed when complete):
    ctranslate2: model.bin, config.json, shared_vocabulary.json, tokenizer.json;
    transformers: model.safetensors, config.json, generation_config.json, tokenizer.json,
    tokenizer_config.json; both: README.md (model card: data, parameters, BLEU with its
    sacreBLEU signature) and aiayn.json (the model's configuration and the export's check).
    """
    from aiayn.export.convert import check_request, load_model_folder
    from aiayn.export.convert import export as export_folder
    from aiayn.export.model_card import model_card
    from aiayn.model import count_parameters

    p = read_params(params)
    check_request(fmt, quantization)  # a missing package or a bad pair of options: no work
    out = out or Path("data/export") / fmt
    found = {name: _metrics_file(metrics / f"{name}.json") for name in METRICS}
    folder = load_model_folder(model)

    def card(check: float) -> str:
        return model_card(fmt, folder.config, src_lang=p.data.src_lang,
                          tgt_lang=p.data.tgt_lang, beam=p.decode.beam, alpha=p.decode.alpha,
                          parameters=count_parameters(folder.model), quantization=quantization,
                          metrics=found, check=check)

    result = export_folder(folder, out, fmt, quantization=quantization, beam=p.decode.beam,
                           alpha=p.decode.alpha, card=card)
    log.info("export: wrote %s (%s)", result.directory, ", ".join(result.files))


def _metrics_file(path: Path) -> dict | None:
    """A metrics file for the model card; None where it is missing or unreadable (the card
    then says "not measured" for its figures), with a warning for the latter."""
    if not path.is_file():
        return None
    try:
        found = read_json(path)
    except (OSError, ValueError) as exc:
        log.warning("export: %s is not readable JSON (%s); the model card leaves its figures "
                    "out (re-run the stage that writes it to put them in)", path, exc)
        return None
    return found if isinstance(found, dict) else None


app = single_command_app(export, "Export the trained model to CTranslate2 or transformers.")

if __name__ == "__main__":
    app()
