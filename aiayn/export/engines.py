"""Translating with an exported model: CTranslate2 or Hugging Face transformers.

Each engine is a :class:`aiayn.decoding.translation.BatchTranslator`, so text is prepared, batched
and put back in order exactly as for our own beam search; only ``decode_batch`` differs.
The folders are those `aiayn export` writes (aiayn/export/convert.py).

Two settings cannot be given per sentence to these engines, and are per batch instead:

* the maximum output length: ours is floor(a * source tokens + b) per sentence; the
  engines get the largest of the batch (sentences are sorted by length into batches, so
  the values are close). Greedy outputs are the same either way up to the cut; a beam
  output can differ only for a sentence that runs to its maximum length;
* the length normalisation: both engines divide by |Y|^alpha (``length_norm="length"``),
  not GNMT's ((5 + |Y|) / 6)^alpha; asked for GNMT with alpha > 0 they refuse.

CTranslate2 stops a beam when ``beam x patience`` hypotheses have finished (``patience`` 1
by default), which is not always the exact stopping rule of ours (aiayn/decoding/beam.py) and of
transformers with ``early_stopping="never"``; ``patience`` large enough makes it search to
the maximum length, and then it returns what an exact search returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from aiayn.data.tokenizer import EOS, EOS_ID, PAD_ID, load_tokenizer
from aiayn.decoding.beam import BeamConfig, max_lengths
from aiayn.decoding.translation import BatchTranslator, load_translator, source_batch
from aiayn.errors import DataError
from aiayn.export.convert import METADATA_FILE, quiet_transformers, require, token_strings
from aiayn.io import read_json

ENGINES = ("aiayn", "ctranslate2", "transformers")


def default_model_dir(engine: str) -> Path:
    """Where the pipeline keeps the model each engine reads."""
    return Path("data/model") if engine == "aiayn" else Path("data/export") / engine


def _need(directory: Path, names: tuple[str, ...], fmt: str) -> None:
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise DataError(f"{directory}: no {', '.join(missing)}; this is not a folder of "
                        f"`aiayn export --format {fmt}` (run it, or give --model that folder)")


def _exported_shape(directory: Path, fmt: str) -> tuple[int, int]:
    """(vocab_size, max_positions) of the model an export folder was made from."""
    try:
        model = read_json(directory / METADATA_FILE)["source"]["model"]
        return int(model["vocab_size"]), int(model["max_positions"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory / METADATA_FILE}: unreadable or without source.model "
                        f"({type(exc).__name__}: {exc}); re-run `aiayn export --format "
                        f"{fmt}`") from None


def _check_norm(cfg: BeamConfig, engine: str) -> None:
    if cfg.beam > 1 and cfg.alpha != 0 and cfg.length_norm != "length":
        raise DataError(f"--length-norm {cfg.length_norm}: {engine} normalises beam scores by "
                        "|Y|^alpha only; use --length-norm length, alpha 0, or --engine aiayn")


def _batch_max_length(sources: list[list[int]], cfg: BeamConfig, limit: int) -> int:
    return max(max_lengths(source_batch(sources), cfg.max_len_a, cfg.max_len_b, limit))


class CTranslate2Translator(BatchTranslator):
    """Decoding with a ``ctranslate2.Translator`` of an exported model.

    ``vocab[i]`` is the token string of id i; ``tokenizer`` is needed for text only
    (``translate``), not for ``decode_batch``. :meth:`from_folder` opens an export folder.
    """

    def __init__(self, translator: Any, vocab: list[str], max_positions: int,
                 tokenizer: Tokenizer | None = None, patience: float = 1.0):
        self.translator, self.vocab, self.max_positions = translator, vocab, max_positions
        self.token_id = {t: i for i, t in enumerate(vocab)}
        self.tokenizer, self.patience = tokenizer, patience

    @classmethod
    def from_folder(cls, directory: Path, device: str = "cpu", compute_type: str = "default",
                    threads: int = 0, patience: float = 1.0) -> CTranslate2Translator:
        ct2 = require("ctranslate2", "--engine ctranslate2")
        directory = Path(directory)
        _need(directory, ("model.bin", "shared_vocabulary.json", "tokenizer.json",
                          METADATA_FILE), "ctranslate2")
        vocab_size, max_positions = _exported_shape(directory, "ctranslate2")
        tokenizer = load_tokenizer(directory / "tokenizer.json")
        translator = ct2.Translator(str(directory), device=device, compute_type=compute_type,
                                    inter_threads=1, intra_threads=threads)
        return cls(translator, token_strings(tokenizer, vocab_size), max_positions, tokenizer,
                   patience)

    @property
    def max_source_tokens(self) -> int:
        return self.max_positions - 1

    def results(self, sources: list[list[int]], cfg: BeamConfig, **options: Any) -> list:
        """CTranslate2's ``TranslationResult`` of each source (ids without EOS); ``options``
        go to ``translate_batch`` (e.g. ``return_scores=True``)."""
        _check_norm(cfg, "CTranslate2")
        return self.translator.translate_batch(
            [[self.vocab[i] for i in s] + [EOS] for s in sources], beam_size=cfg.beam,
            patience=self.patience, length_penalty=cfg.alpha,
            max_decoding_length=_batch_max_length(sources, cfg, self.max_positions),
            min_decoding_length=0, max_input_length=0, **options)

    def decode_batch(self, sources: list[list[int]], cfg: BeamConfig) -> list[list[int]]:
        if _batch_max_length(sources, cfg, self.max_positions) == 0:
            return [[] for _ in sources]
        return [[self.token_id[t] for t in r.hypotheses[0]] for r in self.results(sources, cfg)]


class TransformersTranslator(BatchTranslator):
    """Decoding with ``generate`` of an exported ``MarianMTModel``.

    ``tokenizer`` is needed for text only (``translate``). :meth:`from_folder` opens an
    export folder.
    """

    def __init__(self, model: Any, tokenizer: Tokenizer | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device = next(model.parameters()).device
        self.max_positions = int(model.config.max_position_embeddings)

    @classmethod
    def from_folder(cls, directory: Path, device: str = "cpu") -> TransformersTranslator:
        transformers = quiet_transformers()
        directory = Path(directory)
        _need(directory, ("config.json", "model.safetensors", "tokenizer.json", METADATA_FILE),
              "transformers")
        vocab_size, _ = _exported_shape(directory, "transformers")
        tokenizer = load_tokenizer(directory / "tokenizer.json")
        token_strings(tokenizer, vocab_size)  # the tokenizer belongs to the model, or an error
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(directory)).to(device)
        return cls(model, tokenizer)

    @property
    def max_source_tokens(self) -> int:
        return self.max_positions - 1

    @torch.no_grad()
    def generate(self, sources: list[list[int]], cfg: BeamConfig, **options: Any) -> Any:
        """``model.generate`` on the sources (ids without EOS); its raw output. ``options``
        go to ``generate`` (e.g. ``output_scores=True, return_dict_in_generate=True``)."""
        _check_norm(cfg, "transformers")
        src = source_batch(sources).to(self.device)
        search = dict(num_beams=cfg.beam, length_penalty=cfg.alpha, early_stopping="never",
                      num_return_sequences=1) if cfg.beam > 1 else {"num_beams": 1}
        return self.model.generate(
            input_ids=src, attention_mask=(src != PAD_ID).long(), do_sample=False,
            max_new_tokens=_batch_max_length(sources, cfg, self.max_positions),
            **search, **options)

    def decode_batch(self, sources: list[list[int]], cfg: BeamConfig) -> list[list[int]]:
        if _batch_max_length(sources, cfg, self.max_positions) == 0:
            return [[] for _ in sources]
        return [strip_generated(row) for row in self.generate(sources, cfg).tolist()]


def strip_generated(row: list[int]) -> list[int]:
    """A ``generate`` output row without its decoder start, EOS and the padding after it."""
    out = row[1:]
    return out[:out.index(EOS_ID)] if EOS_ID in out else out


def load_engine(engine: str, model_dir: Path, device: str = "auto",
                precision: str = "fp32", **engine_options: Any) -> BatchTranslator:
    """The translator of ``engine`` ("aiayn", "ctranslate2" or "transformers").
    ``engine_options`` go to the engine's ``from_folder``: for ctranslate2 ``patience``,
    ``compute_type`` and ``threads`` (:meth:`CTranslate2Translator.from_folder`); aiayn and
    transformers take none."""
    if engine == "aiayn":
        return load_translator(model_dir, device=device, precision=precision, **engine_options)
    if precision != "fp32":
        raise DataError(f"--precision {precision} applies to --engine aiayn; a ctranslate2 "
                        "export runs at the type it was exported with (aiayn export "
                        "--quantization), a transformers export in fp32")
    if engine == "ctranslate2":
        if device == "auto":
            ct2 = require("ctranslate2", "--engine ctranslate2")
            device = "cuda" if ct2.get_cuda_device_count() > 0 else "cpu"
        return CTranslate2Translator.from_folder(model_dir, device=device, **engine_options)
    if engine == "transformers":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return TransformersTranslator.from_folder(model_dir, device=device, **engine_options)
    raise DataError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
