"""translate: the averaged model → detokenized translations (a split for DVC, or any text)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
from tqdm import tqdm

from aiayn.config import SPLITS
from aiayn.data.corpus import iter_raw
from aiayn.decoding.beam import BeamConfig
from aiayn.decoding.scoring import utf8_lines
from aiayn.errors import DataError
from aiayn.io import check_output_path, write_text
from stages.common import ParamsPath, log, read_params, single_command_app, stage


@stage
def translate(
    text: Annotated[list[str] | None, typer.Argument(help="Sentences to translate (each argument is one). Without them: --input, --split, or standard input.")] = None,
    params: ParamsPath = Path("params.yaml"),
    input_file: Annotated[Path | None, typer.Option("--input", "-i", help="A file of sentences, one per line ('-': standard input).")] = None,
    split: Annotated[str | None, typer.Option(help="Translate the source side of a raw split (the DVC stage translates valid and test).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output file (default: standard output; with --split: data/translations/{split}.{tgt}).")] = None,
    model: Annotated[Path | None, typer.Option(help="Model folder: from `aiayn average` for --engine aiayn (default data/model), from `aiayn export` for the others (default data/export/ENGINE).")] = None,
    engine: Annotated[Literal["aiayn", "ctranslate2", "transformers"], typer.Option(help="Decoder: aiayn (our beam search, the default), ctranslate2 or transformers (an exported model; `pip install -e '.[export]'`).")] = "aiayn",
    raw: Annotated[Path, typer.Option(help="Raw splits (for --split).")] = Path("data/raw"),
    beam: Annotated[int | None, typer.Option(min=1, help="Beam size (default: decode.beam; 1 is greedy).")] = None,
    alpha: Annotated[float | None, typer.Option(min=0.0, help="Length penalty alpha (default: decode.alpha); see --length-norm.")] = None,
    length_norm: Annotated[Literal["gnmt", "length"] | None, typer.Option(help="Beam scores are log P / lp(Y): gnmt, ((5+|Y|)/6)^alpha (the paper's; aiayn's default), or length, |Y|^alpha (CTranslate2's and transformers', their only one; aiayn can use it too).")] = None,
    max_len_a: Annotated[float | None, typer.Option(min=0.0, help="Max output tokens = a * input tokens + b (default: decode.max_len_a).")] = None,
    max_len_b: Annotated[int | None, typer.Option(min=0, help="See --max-len-a (default: decode.max_len_b).")] = None,
    max_len: Annotated[int | None, typer.Option(min=1, help="A fixed cap on output tokens (instead of a * input + b).")] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Sentences decoded together (default: decode.batch_size).")] = None,
    truncate: Annotated[bool, typer.Option(help="Cut inputs longer than the model's limit instead of stopping with an error.")] = False,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="auto (cuda if a GPU is visible), cpu or cuda.")] = "auto",
    precision: Annotated[Literal["fp32", "bf16", "fp16", "auto"], typer.Option(help="--engine aiayn: fp32; bf16 (the weights converted to bf16); fp16 (the same, for GPUs without bf16); or auto: bf16 on a GPU or CPU with native bf16 (Ampere+; AVX512-BF16, AMX, Arm BF16), else fp32.")] = "fp32",
    progress: Annotated[bool, typer.Option(help="Show a progress bar (sentences/s) on standard error.")] = True,
) -> None:
    """Translate with beam search (paper Section 6.1: beam 4, alpha 0.6, max length input + 50).

    Text comes from the arguments, `--input FILE`, standard input, or, for the DVC stage,
    `--split valid` and `--split test` (the source column of RAW/SPLIT.parquet, written to
    data/translations/SPLIT.{tgt}). Output is detokenized text, one line per input line, in
    the input's order; an empty line gives an empty line. `--engine ctranslate2` or
    `transformers` decodes with a model written by `aiayn export` instead of our own beam
    search (same weights; they take one maximum length per batch, the batch's largest).
    Reads: params `decode.*` (options override them) and `data.src_lang`/`tgt_lang` (for
    --split); MODEL. Writes: OUT (atomically), or standard output.
    """
    from aiayn.export.engines import default_model_dir, load_engine

    p = read_params(params)
    d = p.decode
    cfg = BeamConfig.from_decode(
        d, beam=beam, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b, max_len=max_len,
        length_norm=length_norm or ("gnmt" if engine == "aiayn" else "length"))
    source = "standard input"  # what the lines are, for messages
    if text:
        lines, source = list(text), "the sentences given"
    elif input_file is not None:
        if str(input_file) == "-":
            lines = _utf8_lines(sys.stdin.buffer.read(), "standard input")
        elif not input_file.is_file():
            raise DataError(f"{input_file}: no such file to translate")
        else:
            lines, source = _utf8_lines(input_file.read_bytes(), str(input_file)), str(input_file)
    elif split is not None:
        if split not in SPLITS:
            raise DataError(f"--split {split!r}: not a split of the corpus; choose one of "
                            f"{', '.join(SPLITS)}")
        lines = [t for b in iter_raw(raw, split, columns=[p.data.src_lang])
                 for t in b[p.data.src_lang]]
        source = f"{raw}/{split} ({p.data.src_lang})"
        out = out or Path(f"data/translations/{split}.{p.data.tgt_lang}")
    elif not sys.stdin.isatty():
        lines = _utf8_lines(sys.stdin.buffer.read(), "standard input")
    else:
        raise DataError("nothing to translate: give sentences as arguments, --input FILE, "
                        "--split test, or pipe text into standard input")
    if out is not None:
        check_output_path(out)  # before loading the model and decoding, not after
    translator = load_engine(engine, model or default_model_dir(engine), device=device,
                             precision=precision)
    with tqdm(total=len(lines), desc="translate", unit=" sent", disable=not progress,
              mininterval=1.0, file=sys.stderr) as bar:
        try:
            hyps = translator.translate(lines, cfg, batch_size=batch_size or d.batch_size,
                                        truncate=truncate, progress=bar.update)
        except DataError as exc:  # "input line N ...": say which input
            raise DataError(f"{source}, {exc}" if str(exc).startswith("input line")
                            else str(exc)) from None
    result = "".join(h + "\n" for h in hyps)
    if out is None:
        sys.stdout.write(result)
    else:
        write_text(out, result)
        log.info("translate: %d sentences (%s, beam %d, alpha %.2f, %s) -> %s", len(lines),
                 engine, cfg.beam, cfg.alpha, cfg.length_norm, out)


def _utf8_lines(data: bytes, name: str) -> list[str]:
    """The lines of UTF-8 ``data``, split at newlines only (the score stage's reading, so
    that line i of the output translates line i of the input)."""
    return utf8_lines(data, name, "convert it to UTF-8, e.g. `iconv -f latin1 -t utf-8`")


app = single_command_app(translate, "Translate with the trained model.")

if __name__ == "__main__":
    app()
