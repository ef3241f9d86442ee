"""Text in, text out: a trained model plus its tokenizer, decoding batches by beam search.

Inputs are sorted by length into batches (similar lengths waste little padding), decoded
together, detokenized with the shared BPE (lossless, so no Moses detokenizer guesses), and
returned in the original order. An empty line gives an empty line, and every output is one
line (a line break the model writes becomes a space).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from aiayn.data.corpus import iter_raw
from aiayn.data.tokenizer import EOS_ID, PAD_ID, decode, encode_ids, load_tokenizer
from aiayn.decoding.beam import BeamConfig, beam_search
from aiayn.decoding.scoring import sacre_scores
from aiayn.errors import DataError
from aiayn.fast import avoid_cudnn_attention
from aiayn.io import file_sha256
from aiayn.model import Transformer, TransformerConfig
from aiayn.precision import autocast_dtype, slow_bf16_warning
from aiayn.training.checkpoint import load_checkpoint, load_model_files

log = logging.getLogger("aiayn")


class BatchTranslator:
    """Text in, text out, for any decoder of token ids: ours, or an exported model's engine
    (aiayn/export/engines.py). Subclasses set ``tokenizer`` and ``max_source_tokens`` and implement
    ``decode_batch``; the line handling (stripping, limits, length-sorted batches, empty
    lines, original order) is this one ``translate`` for all of them.
    """

    tokenizer: Tokenizer

    @property
    def max_source_tokens(self) -> int:
        raise NotImplementedError

    def decode_batch(self, sources: list[list[int]], cfg: BeamConfig) -> list[list[int]]:
        """Token ids of each source (without EOS) → the best output ids (without BOS/EOS)."""
        raise NotImplementedError

    def translate(self, lines: Sequence[str], cfg: BeamConfig, batch_size: int = 128,
                  truncate: bool = False, progress: Callable[[int], None] | None = None
                  ) -> list[str]:
        """Translate ``lines``; the i-th output translates the i-th input."""
        ids = encode_ids(self.tokenizer, [line.strip() for line in lines])
        limit = self.max_source_tokens
        for i, seq in enumerate(ids):
            if len(seq) > limit:
                if not truncate:
                    raise DataError(
                        f"input line {i + 1} has {len(seq)} tokens, more than the model's "
                        f"limit of {limit} (model.max_positions - 1); shorten it or pass "
                        "--truncate to cut it")
                ids[i] = seq[:limit]
        out = [""] * len(lines)
        todo = sorted((i for i, seq in enumerate(ids) if seq), key=lambda i: len(ids[i]))
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            best = self.decode_batch([ids[i] for i in chunk], cfg)
            for i, hyp in zip(chunk, best, strict=True):
                out[i] = one_line(decode(self.tokenizer, hyp))
            if progress:
                progress(len(chunk))
        if progress:
            progress(len(lines) - len(todo))  # empty lines count as done
        return out


def one_line(text: str) -> str:
    """A translation as one line: the line breaks a model may write (the byte-level
    vocabulary holds them; an undertrained model does emit them) become spaces, or the
    output file would no longer hold one line per input line."""
    return _BREAKS.sub(" ", text)


_BREAKS = re.compile(r"[ \t]*[\r\n]+[ \t]*")


def source_batch(sources: list[list[int]]) -> Tensor:
    """(B, S): each source's ids + EOS, right-padded with PAD (what the encoder reads)."""
    width = max(len(seq) for seq in sources) + 1
    src = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(sources):
        src[row, :len(seq) + 1] = torch.tensor(seq + [EOS_ID])
    return src


def decoding_model(model: Transformer, dtype: torch.dtype | None,
                   copy: bool = False) -> Transformer:
    """``model`` with its weights in ``dtype`` (bf16 or fp16; None: as it is), for decoding:
    then no product casts its inputs, where autocast casts every activation (a quarter of a
    beam search's time on a bf16 CPU). The log-probabilities stay fp32 (aiayn.decoding.beam), layer
    norms accumulate in fp32, and CPU attention keeps fp32 scores (``attend``). ``copy``:
    leave ``model`` as it is (a model in training) and convert a copy."""
    if dtype is None or next(model.parameters()).dtype == dtype:
        return model
    return (deepcopy(model) if copy else model).to(dtype)


@dataclass
class Translator(BatchTranslator):
    """Our model and beam search (aiayn/decoding/beam.py), decoding in ``amp_dtype`` (None: fp32): a
    model whose weights are fp32 under autocast, one converted by :func:`decoding_model`
    (what :func:`load_translator` and :class:`ValidationBleu` pass) without it."""

    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    amp_dtype: torch.dtype | None = None

    @property
    def max_source_tokens(self) -> int:
        return self.model.cfg.max_positions - 1  # room for EOS

    def decode_batch(self, sources: list[list[int]], cfg: BeamConfig) -> list[list[int]]:
        src = source_batch(sources).to(self.device)
        weights = next(self.model.parameters()).dtype
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None and weights != self.amp_dtype):
            return beam_search(self.model, src, cfg)


@dataclass
class ValidationBleu:
    """The trainer's hook for BLEU while training: translate ``sources`` with the weights of
    the moment and score sacreBLEU against the raw ``references``, as ``aiayn score`` does.

    The model is switched to eval mode and back, and under bf16 or fp16 a copy in that
    dtype decodes (:func:`decoding_model`); decoding never touches the random number
    generators, so a run's training is the same with and without the hook.
    """

    sources: list[str]
    references: list[str]
    tokenizer: Tokenizer
    beam: BeamConfig
    target_lang: str
    batch_size: int = 128

    @classmethod
    def from_params(cls, p, raw: Path, tokenizer: Tokenizer) -> ValidationBleu:
        """The valid split of the raw data in ``raw`` (or its first
        ``train.valid_bleu_sentences``), decoded as ``train.valid_bleu_beam`` / ``_alpha`` say."""

        src, tgt = p.data.src_lang, p.data.tgt_lang
        sources, references = [], []
        for batch in iter_raw(raw, "valid", columns=[src, tgt]):
            sources += batch[src]
            references += batch[tgt]
        if p.train.valid_bleu_sentences:
            sources = sources[:p.train.valid_bleu_sentences]
            references = references[:p.train.valid_bleu_sentences]
        beam = BeamConfig(beam=p.train.valid_bleu_beam, alpha=p.train.valid_bleu_alpha)
        return cls(sources, references, tokenizer, beam, tgt, p.decode.batch_size)

    def __call__(self, model: Transformer, device: torch.device,
                 amp_dtype: torch.dtype | None = None) -> float:

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                decoder = decoding_model(model, amp_dtype, copy=True)
                hypotheses = Translator(decoder, self.tokenizer, device, amp_dtype).translate(
                    self.sources, self.beam, self.batch_size, truncate=True)
        finally:
            model.train(was_training)
        return sacre_scores(hypotheses, self.references, self.target_lang)["bleu"]["score"]


def model_tokenizer(model_dir: Path, config: dict) -> tuple[Path, Tokenizer]:
    """The model folder's tokenizer.json, checked against the sha256 in its config.json."""

    tok_path = model_dir / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    expected = config.get("tokenizer_sha256")
    if expected and file_sha256(tok_path) != expected:
        raise DataError(f"{tok_path}: not the tokenizer this model was trained with (sha256 "
                        f"differs from {model_dir / 'config.json'}); re-run `aiayn average`")
    return tok_path, tok


def decode_device(device: str) -> torch.device:
    """``auto`` (cuda if a GPU is visible), ``cpu`` or ``cuda``, made ready for decoding."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else ("cpu" if device == "auto" else device))
    avoid_cudnn_attention(dev)
    return dev


def load_translator(model_dir: Path, device: str = "auto", precision: str = "fp32"
                    ) -> Translator:
    """The averaged model in ``model_dir`` (safetensors + config.json + tokenizer.json)."""

    state, config = load_model_files(model_dir)
    tok_path, tok = model_tokenizer(model_dir, config)
    cfg = TransformerConfig(**config["model"])
    if tok.get_vocab_size() != cfg.vocab_size:
        raise DataError(f"{tok_path} has {tok.get_vocab_size()} tokens but the model in "
                        f"{model_dir} has {cfg.vocab_size}; they do not belong together")
    return _translator(cfg, state, tok, device, precision)


def load_checkpoint_translator(checkpoint: Path, tokenizer: Path, device: str = "auto",
                               precision: str = "fp32") -> Translator:
    """One training checkpoint (``step-*.pt``: its own weights, not an average) with the
    tokenizer it was trained with (its sha256 is checked against the checkpoint's record),
    as :func:`load_translator` opens a model folder."""
    from aiayn.training.averaging import check_tokenizer, checkpoint_meta

    checkpoint, tokenizer = Path(checkpoint), Path(tokenizer)
    state = load_checkpoint(checkpoint, mmap=True)
    meta = checkpoint_meta(checkpoint, state)
    check_tokenizer(tokenizer, meta["tokenizer_sha256"], f"{checkpoint} was trained with")
    cfg = TransformerConfig(**meta["model_config"])
    return _translator(cfg, state["model"], load_tokenizer(tokenizer), device, precision)


def _translator(cfg: TransformerConfig, state: dict[str, Tensor], tok: Tokenizer, device: str,
                precision: str) -> Translator:
    dev = decode_device(device)
    model = Transformer(cfg)
    model.load_state_dict(state)
    model.to(dev).eval()
    if warning := slow_bf16_warning(precision, dev, "--precision"):
        log.warning(warning)
    dtype = autocast_dtype(precision, dev)
    return Translator(decoding_model(model, dtype), tok, dev, dtype)
