"""vocab: raw train split → one shared BPE tokenizer (data/vocab/tokenizer.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from tqdm import tqdm

from aiayn.data.corpus import iter_raw, open_raw, raw_languages, raw_rows
from aiayn.data.tokenizer import UNK_ID, encode_ids, save_tokenizer, train_bpe
from aiayn.errors import DataError
from aiayn.io import check_output_path, write_json
from stages.common import ParamsPath, log, read_params, single_command_app, stage


def sample_rows(start: int, count: int, n_pairs: int, n_rows: int) -> list[int] | None:
    """Rows of [start, start + count) in an evenly spread sample of n_pairs of n_rows.

    Row i is kept when floor(i * n_pairs / n_rows) steps up at i, which keeps exactly
    n_pairs rows, spread over the whole file (the corpus may be ordered by source).
    None means every row.
    """
    if n_pairs >= n_rows:
        return None
    return [i - start for i in range(start, start + count)
            if (i * n_pairs) // n_rows != ((i + 1) * n_pairs) // n_rows]


@stage
def vocab(
    params: ParamsPath = Path("params.yaml"),
    raw: Annotated[Path, typer.Option(help="Folder of raw splits from `aiayn download`.")] = Path("data/raw"),
    out: Annotated[Path, typer.Option(help="Where the tokenizer JSON is written.")] = Path("data/vocab/tokenizer.json"),
    metrics: Annotated[Path, typer.Option(help="Vocabulary size, unknown rate, tokens per sentence.")] = Path("metrics/vocab.json"),
) -> None:
    """Train one byte-level BPE vocabulary shared by both languages (paper Section 5.1).

    Reads: params `vocab.vocab_size`, `vocab.min_frequency`, `vocab.max_pairs` (train on an
    evenly spread sample of that many pairs; 0: all); RAW/train.parquet (both columns).
    Writes: OUT (a Hugging Face `tokenizers` JSON; ids 0-3 are `<pad>` `<s>` `</s>` `<unk>`) and
    METRICS with the vocabulary size and, on the held-out valid split, the unknown-token
    rate and the mean tokens per sentence for each language. Decoding is lossless.
    """
    p = read_params(params)
    check_output_path(out)
    check_output_path(metrics)
    langs = raw_languages(raw)
    missing = [lang for lang in p.data.languages if lang not in langs]
    if missing:
        raise DataError(f"{raw}/train.parquet has columns {langs}, not {missing}; "
                        "re-run `aiayn download` after changing data.src_lang/tgt_lang")
    open_raw(raw, "valid", langs)  # measured on after training: fail now if it cannot be
    n_rows = raw_rows(raw, "train")
    n_pairs = min(n_rows, p.vocab.max_pairs) if p.vocab.max_pairs else n_rows
    n_sentences = n_pairs * len(langs)
    log.info("vocab: training BPE (size %d, min frequency %d) on %d sentences%s",
             p.vocab.vocab_size, p.vocab.min_frequency, n_sentences,
             f" (a sample of {n_pairs} of {n_rows} pairs)" if n_pairs < n_rows else "")
    with tqdm(total=n_sentences, desc="vocab: reading train", unit=" sent", unit_scale=True,
              mininterval=1.0) as bar:
        def texts():
            # Whole batches: tokenizers takes lists, and the bar updates once per batch.
            start = 0
            for batch in iter_raw(raw, "train", columns=langs):
                keep = sample_rows(start, len(batch[langs[0]]), n_pairs, n_rows)
                start += len(batch[langs[0]])
                for lang in langs:
                    chosen = [batch[lang][i] for i in keep] if keep is not None else batch[lang]
                    bar.update(len(chosen))
                    yield chosen

        tok = train_bpe(texts(), p.vocab.vocab_size, p.vocab.min_frequency, length=n_sentences)

    # Everything that can fail on bad input comes before the first write, so that a failure
    # leaves OUT and METRICS as they were, not a new tokenizer beside old metrics.
    summary: dict = {"size": tok.get_vocab_size(), "requested_size": p.vocab.vocab_size,
                     "min_frequency": p.vocab.min_frequency, "trained_on_pairs": n_pairs,
                     "measured_on": "valid"}
    for lang in langs:
        lengths, unknown = [], 0
        for batch in iter_raw(raw, "valid", columns=[lang]):
            for ids in encode_ids(tok, batch[lang]):
                lengths.append(len(ids))
                unknown += sum(1 for i in ids if i == UNK_ID)
        total = int(np.sum(lengths))
        summary[lang] = {"mean_tokens_per_sentence": float(np.mean(lengths)),
                         "unknown_rate": unknown / max(total, 1)}
    save_tokenizer(tok, out)
    write_json(metrics, summary)
    log.info("vocab: %d tokens; valid tokens/sentence %s", tok.get_vocab_size(),
             {lang: round(summary[lang]["mean_tokens_per_sentence"], 1) for lang in langs})


app = single_command_app(vocab, "Train the shared BPE vocabulary.")

if __name__ == "__main__":
    app()
