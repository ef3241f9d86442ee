"""vocab: raw train split → one shared BPE tokenizer (data/vocab/tokenizer.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from tqdm import tqdm

from aiayn.corpus import iter_raw, raw_languages, raw_rows
from aiayn.errors import DataError
from aiayn.io import write_json
from aiayn.tokenizer import UNK_ID, encode_ids, save_tokenizer, train_bpe
from stages.common import ParamsPath, log, read_params, single_command_app, stage


@stage
def vocab(
    params: ParamsPath = Path("params.yaml"),
    raw: Annotated[Path, typer.Option(help="Folder of raw splits from `aiayn download`.")] = Path("data/raw"),
    out: Annotated[Path, typer.Option(help="Where the tokenizer JSON is written.")] = Path("data/vocab/tokenizer.json"),
    metrics: Annotated[Path, typer.Option(help="Vocabulary size, unknown rate, tokens per sentence.")] = Path("metrics/vocab.json"),
) -> None:
    """Train one byte-level BPE vocabulary shared by both languages (paper Section 5.1).

    Reads: params `vocab.vocab_size`, `vocab.min_frequency`; RAW/train.parquet (both columns).
    Writes: OUT (a Hugging Face `tokenizers` JSON; ids 0-3 are <pad> <s> </s> <unk>) and
    METRICS with the vocabulary size and, on the held-out valid split, the unknown-token
    rate and the mean tokens per sentence for each language. Decoding is lossless.
    """
    p = read_params(params)
    langs = raw_languages(raw)
    missing = [lang for lang in p.data.languages if lang not in langs]
    if missing:
        raise DataError(f"{raw}/train.parquet has columns {langs}, not {missing}; "
                        "re-run `aiayn download` after changing data.src_lang/tgt_lang")
    n_sentences = raw_rows(raw, "train") * len(langs)
    log.info("vocab: training BPE (size %d, min frequency %d) on %d sentences",
             p.vocab.vocab_size, p.vocab.min_frequency, n_sentences)
    with tqdm(total=n_sentences, desc="vocab: reading train", unit=" sent", unit_scale=True,
              mininterval=1.0) as bar:
        def texts():
            # Whole batches: tokenizers takes lists, and the bar updates once per batch.
            for batch in iter_raw(raw, "train", columns=langs):
                for lang in langs:
                    bar.update(len(batch[lang]))
                    yield batch[lang]

        tok = train_bpe(texts(), p.vocab.vocab_size, p.vocab.min_frequency, length=n_sentences)
    save_tokenizer(tok, out)

    summary: dict = {"size": tok.get_vocab_size(), "requested_size": p.vocab.vocab_size,
                     "min_frequency": p.vocab.min_frequency, "measured_on": "valid"}
    for lang in langs:
        lengths, unknown = [], 0
        for batch in iter_raw(raw, "valid", columns=[lang]):
            for ids in encode_ids(tok, batch[lang]):
                lengths.append(len(ids))
                unknown += sum(1 for i in ids if i == UNK_ID)
        total = int(np.sum(lengths))
        summary[lang] = {"mean_tokens_per_sentence": float(np.mean(lengths)),
                         "unknown_rate": unknown / max(total, 1)}
    write_json(metrics, summary)
    log.info("vocab: %d tokens; valid tokens/sentence %s", tok.get_vocab_size(),
             {lang: round(summary[lang]["mean_tokens_per_sentence"], 1) for lang in langs})


app = single_command_app(vocab, "Train the shared BPE vocabulary.")

if __name__ == "__main__":
    app()
