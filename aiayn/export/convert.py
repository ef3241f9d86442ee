"""A trained model for other inference engines: CTranslate2 and Hugging Face transformers.

Both exports compute what our decoder computes, weight for weight; nothing is retrained or
approximated. An export folder is written to a temporary folder, checked (the exported
model, loaded back by its engine, must give our per-token log-probabilities of a probe
translation within 1e-3; unquantized exports agree to about 1e-6), and only then renamed
into place: a failure leaves nothing half-written.

Both engines normalise beam scores by |Y|^alpha (|Y| with EOS), not by GNMT's
((5 + |Y|) / 6)^alpha of the paper and of ``aiayn translate``; ``BeamConfig(length_norm=
"length")`` makes our beam search use theirs (see aiayn/decoding/beam.py). The two agree at alpha 0.

PAD and BOS
-----------
Our beam search sets the logits of PAD and BOS to -inf before the log-softmax: they are
never generated, and log P of an output is normalised over the other tokens. Both exports
bake that rule into the model as an output bias of -inf at those two ids (CTranslate2:
the decoder projection's bias; transformers: MarianMTModel's ``final_logits_bias``), so
that any search, sampling or scoring in those engines sees the same distribution as ours,
without options at call time. Our teacher-forced logits (training) never include it. A
model trained with ``model.output_vocab: target`` has -inf at every token outside its output
vocabulary too; the same bias carries it.

CTranslate2 (``ctranslate2.specs.TransformerSpec``)
---------------------------------------------------
Filled weight by weight from the state dict, as the fairseq / OpenNMT-py converters of
``ctranslate2.converters`` do, into ``TransformerSpec.from_config((encoder_layers,
decoder_layers), heads, pre_norm=(norm == "pre"), activation=RELU)``:

* the one shared matrix is the encoder and decoder embeddings and the output projection
  (the saver aliases the copies); ``scale_embeddings`` multiplies by sqrt(d_model);
* ``position_encodings`` = our table (interleaved sin/cos; CTranslate2's built-in table
  concatenates sin and cos, so ours is passed explicitly); row 0 is the decoder's first
  position (BOS) as ours;
* per layer: self-attention ``linear[0]`` = the fused ``qkv_proj`` (rows q, k, v, as
  CTranslate2 expects), ``linear[1]`` = ``out_proj``; cross-attention ``linear[0]`` =
  ``q_proj``, ``linear[1]`` = the fused ``kv_proj``, ``linear[2]`` = ``out_proj``; each
  block's ``layer_norm`` = that residual block's LayerNorm (applied after the residual sum
  when ``pre_norm`` is False, as ours); ``ffn.linear_0/1`` = ``w1``/``w2``; pre-LN models
  also get each stack's final LayerNorm;
* ``layer_norm_epsilon`` 1e-5 (``nn.LayerNorm``'s; CTranslate2's default is 1e-6);
* one vocabulary for both sides: token string i for our id i (the BPE's own strings);
  decoder start ``<s>``, end ``</s>``; the source is given with its ``</s>``;
* ``position_encodings`` is the model's own table either way, so learned positions
  (``model.positions: learned``, Table 3 row (E)) export as they are;
* ``spec.optimize(quantization)`` quantizes the weights (int8, int16, float16, bfloat16 and
  their mixes, as CTranslate2 offers) or keeps float32 (``none``).

The folder also holds our ``tokenizer.json`` (to make token strings from text) and
``aiayn.json`` (the model's configuration and how it was exported). Decode with
``min_decoding_length=0`` (CTranslate2's default of 1 forbids the empty output ours allows)
and ``max_input_length=0`` (its default cuts sources at 1024 tokens).

Hugging Face transformers (``MarianMTModel``)
---------------------------------------------
Marian is the paper's architecture in ``transformers``: post-LN encoder and decoder,
sinusoidal positions, embeddings scaled by sqrt(d_model) and shared with the output
projection, biases everywhere, a configurable activation. What differs, and its mapping:

* Positions. Marian's table puts sin(pos * w_i) in dimension i and cos(pos * w_i) in
  d/2 + i ([sin | cos] halves); ours puts them in 2i and 2i + 1. Marian computes its table
  at load time (it is not saved), so instead the hidden dimensions are permuted: Marian's
  dimension m holds our dimension perm[m] = (0, 2, ..., d-2, 1, 3, ..., d-1)[m]. Then the
  tables are equal (bit for bit in float32: both are sin/cos in float64, rounded once), and
  every weight that touches the residual stream is permuted alike: the embedding's columns,
  the input columns of q/k/v and fc1, the output rows (and biases) of out_proj and fc2, and
  every LayerNorm's gamma and beta (a LayerNorm's mean and variance do not depend on the
  order of its dimensions). Attention heads and FFN hidden units are untouched, and the
  logits are unchanged: (h P)(E P)^T = h E^T.
* Fused ``qkv_proj`` / ``kv_proj`` are split into q_proj, k_proj, v_proj (rows in order).
* ``scale_embedding`` True (sqrt(d_model)); ``share_encoder_decoder_embeddings`` and
  ``tie_word_embeddings`` True; ``activation_function`` relu; LayerNorm epsilon 1e-5 (Marian
  uses ``nn.LayerNorm``'s default, as ours); no final LayerNorm (post-LN). Marian has no
  pre-LN variant: a pre-LN model cannot be exported to it (an error says so).
* Decoder start = our BOS (``decoder_start_token_id`` 1), EOS 2, PAD 0;
  ``forced_eos_token_id`` none (ours cuts a hypothesis at the maximum length without EOS,
  Marian's default would force one).
* EOS on the source: the tokenizer's post-processor appends ``</s>``, as our source batches
  do. The tokenizer is ours (``tokenizer.json``) as a ``PreTrainedTokenizerFast``: no
  sentencepiece, no custom code; ``clean_up_tokenization_spaces`` False, so decoding gives
  our lossless text back.
* ``generation_config.json``: ``num_beams`` and ``length_penalty`` from ``decode.beam`` and
  ``decode.alpha`` (|Y|^alpha, see above), ``early_stopping="never"`` (the exact stopping
  rule, as ours; transformers' default is a heuristic), ``max_length`` = max_positions.

* Learned positions (``model.positions: learned``) cannot be exported: Marian computes its
  sinusoid table at load time and has no setting for a learned one (an error says so;
  CTranslate2 takes them).

Attention heads of other sizes (``model.d_k``, ``model.d_v``; Table 3 rows (A), (B))
---------------------------------------------------------------------------------------
Both engines give every head one size for queries, keys and values, and scale scores by
1/sqrt(of that size). A model with d_k != d_v is exported with heads of d = max(d_k, d_v):
each head's queries and keys (or values) get zero rows up to d, the output projection zero
columns for padded values, and the query weights and bias are multiplied by sqrt(d / d_k),
so that the engine's 1/sqrt(d) scales by 1/sqrt(d_k) as ours. Zeros add nothing to a dot
product or a weighted sum: the engine computes our function (to float rounding), with
(2 + 1) * heads * (d - min(d_k, d_v)) unused rows per layer's attention. Where
heads * d != d_model (say 8 heads of 128 in d_model 512), CTranslate2 is told its
``head_dim``; Marian derives its head size as d_model / heads and has no such setting, so
such a model is refused for transformers, with the reason, and exports to CTranslate2.
Every row of Table 3 has heads * max(d_k, d_v) = d_model.

``transformers`` 5 removed the ``translation`` pipeline; the folder loads with
``pipeline("translation", model=DIR)`` in transformers 4.x and with
``AutoModelForSeq2SeqLM`` + ``AutoTokenizer`` in both.
"""

from __future__ import annotations

import importlib
import logging
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from aiayn.data.tokenizer import (
    BOS,
    BOS_ID,
    EOS,
    EOS_ID,
    PAD,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK,
)
from aiayn.decoding.beam import greedy_search
from aiayn.decoding.translation import model_tokenizer, source_batch
from aiayn.errors import DataError, MissingPackageError
from aiayn.io import atomic_path, read_json, write_json, write_text
from aiayn.model import Transformer, TransformerConfig
from aiayn.training.checkpoint import CONFIG_FILE, load_model_files

log = logging.getLogger("aiayn")

FORMATS = ("ctranslate2", "transformers")
# "none" keeps float32 weights; the others are CTranslate2's quantization types.
QUANTIZATIONS = ("none", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                 "float16", "bfloat16")
BANNED_IDS = (PAD_ID, BOS_ID)  # never generated (aiayn/decoding/beam.py): -inf output bias
METADATA_FILE = "aiayn.json"
INSTALL_HINT = "pip install -e '.[export]' (from the repository's root)"
# An export is refused if its engine's per-token log-probabilities of the probe differ from
# ours by more than this (unquantized; they agree to ~1e-6 in float32).
CHECK_TOLERANCE = 1e-3


def require(module: str, purpose: str) -> Any:
    """Import an optional package, or stop with one line that says what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(
            f"{purpose} needs the Python package '{module}', which is not installed; "
            f"install the export extras: {INSTALL_HINT}") from None


def quiet_transformers() -> Any:
    """Import transformers without its progress bars and advisory warnings on our output."""
    transformers = require("transformers", "the transformers format")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def token_strings(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """The token string of every id 0 .. vocab_size - 1 (the vocabulary engines read)."""
    vocab = [tokenizer.id_to_token(i) for i in range(vocab_size)]
    missing = [i for i, t in enumerate(vocab) if t is None]
    if missing or tokenizer.get_vocab_size() != vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens (ids missing: "
                        f"{missing[:5]}) but the model has {vocab_size}; they do not belong "
                        "together")
    return vocab


def output_bias(model: Transformer) -> Tensor:
    """0 everywhere, -inf at PAD and BOS (our beam search's rule, as a logit bias) and, for
    ``model.output_vocab: target``, at every token outside the output vocabulary (the
    model's own bias)."""
    vocab = model.output_vocab()
    bias = (torch.zeros(model.cfg.vocab_size) if vocab is None
            else vocab.logit_bias(model.cfg.vocab_size))
    bias[list(BANNED_IDS)] = float("-inf")
    return bias


def engine_head_size(cfg: TransformerConfig) -> int:
    """The one per-head size of queries, keys and values an engine's attention gets:
    max(d_k, d_v) (module docstring)."""
    return max(cfg.key_size, cfg.value_size)


def engine_attention(sd: dict[str, Tensor], name: str, cfg: TransformerConfig,
                     cross: bool) -> dict[str, tuple[Tensor, Tensor]]:
    """(weight, bias) of the q, k, v and out projections of our attention ``name``, with
    heads of :func:`engine_head_size`: zero rows after each head's queries, keys and values
    up to that size, zero columns in the output projection, queries scaled by
    sqrt(size / d_k). With d_k = d_v (the paper's base) the weights are ours, unchanged."""
    h, dk, dv = cfg.heads, cfg.key_size, cfg.value_size
    d = engine_head_size(cfg)
    if cross:
        q = sd[f"{name}.q_proj.weight"], sd[f"{name}.q_proj.bias"]
        kv_w = sd[f"{name}.kv_proj.weight"].split([h * dk, h * dv])
        kv_b = sd[f"{name}.kv_proj.bias"].split([h * dk, h * dv])
        k, v = (kv_w[0], kv_b[0]), (kv_w[1], kv_b[1])
    else:
        w = sd[f"{name}.qkv_proj.weight"].split([h * dk, h * dk, h * dv])
        b = sd[f"{name}.qkv_proj.bias"].split([h * dk, h * dk, h * dv])
        q, k, v = ((w[i], b[i]) for i in range(3))

    def rows(t: Tensor, size: int) -> Tensor:  # (h * size, ...) -> (h * d, ...)
        heads = t.reshape(h, size, *t.shape[1:])
        zeros = heads.new_zeros(h, d - size, *t.shape[1:])
        return torch.cat([heads, zeros], dim=1).reshape(h * d, *t.shape[1:])

    scale = math.sqrt(d / dk)  # 1.0 where d = d_k: the weights stay bit for bit
    out_w = sd[f"{name}.out_proj.weight"]  # (d_model, h * d_v)
    out_w = rows(out_w.t(), dv).t().contiguous()
    return {"q": (rows(q[0], dk) * scale, rows(q[1], dk) * scale),
            "k": (rows(k[0], dk), rows(k[1], dk)),
            "v": (rows(v[0], dv), rows(v[1], dv)),
            "out": (out_w, sd[f"{name}.out_proj.bias"])}


# -- loading what `aiayn average` wrote -----------------------------------------------------

@dataclass
class ModelFolder:
    """An `aiayn average` folder, loaded and checked: the model, its tokenizer, its config."""

    path: Path
    model: Transformer
    tokenizer: Tokenizer
    tokenizer_path: Path
    config: dict  # config.json as written by `aiayn average`

    @property
    def cfg(self) -> TransformerConfig:
        return self.model.cfg


def load_model_folder(model_dir: Path) -> ModelFolder:
    """Weights, config and tokenizer of ``model_dir``; any gap is a DataError naming the file."""

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise DataError(f"{model_dir}: no such model folder; run `aiayn average` (or give "
                        "--model the folder it wrote)")
    state, config = load_model_files(model_dir)
    if not isinstance(config.get("model"), dict):
        raise DataError(f"{model_dir / CONFIG_FILE}: no 'model' section (the model "
                        "configuration); this folder was not written by `aiayn average`")
    try:
        cfg = TransformerConfig(**config["model"])
        model = Transformer(cfg)
        model.load_state_dict(state, strict=True)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"{model_dir}: the weights do not fit the configuration in "
                        f"{CONFIG_FILE} ({str(exc)[:300]}); re-run `aiayn average`") from None
    tok_path, tokenizer = model_tokenizer(model_dir, config)
    token_strings(tokenizer, cfg.vocab_size)  # ids 0..V-1 all present
    return ModelFolder(model_dir, model.eval(), tokenizer, tok_path, config)


def check_exportable(cfg: TransformerConfig, fmt: str) -> None:
    """Stop before any work if ``fmt`` cannot express this model exactly."""
    if fmt not in FORMATS:
        raise DataError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "transformers":
        if cfg.norm != "post":
            raise DataError(
                f"model.norm is {cfg.norm!r}: MarianMT, the transformers architecture that "
                "computes ours, is post-LN only (LayerNorm after each residual sum, no final "
                "LayerNorm), so a pre-LN model cannot be exported to it exactly; export it "
                "with --format ctranslate2 (which has pre-LN), or train with model.norm: post")
        if cfg.d_model % 2:
            raise DataError(f"model.d_model is {cfg.d_model}: the sinusoid layouts of ours "
                            "and Marian map onto each other only for an even d_model")
        if cfg.positions != "sinusoidal":
            raise DataError(
                f"model.positions is {cfg.positions!r}: MarianMT, the transformers "
                "architecture that computes ours, computes a sinusoid table at load time and "
                "has no learned position embeddings, so this model cannot be exported to it "
                "exactly; export it with --format ctranslate2 (which reads our table)")
        if cfg.heads * engine_head_size(cfg) != cfg.d_model:
            raise DataError(
                f"model.heads {cfg.heads} x max(d_k {cfg.key_size}, d_v {cfg.value_size}) = "
                f"{cfg.heads * engine_head_size(cfg)}, not d_model {cfg.d_model}: MarianMT's "
                "heads are d_model / heads wide, with no setting for another size, so this "
                "model cannot be exported to it exactly; export it with --format ctranslate2 "
                "(which has a head size setting)")


# -- CTranslate2 -----------------------------------------------------------------------------

def ctranslate2_spec(model: Transformer, vocab: list[str]) -> Any:
    """The ``TransformerSpec`` of ``model`` (see the module docstring); ``vocab[i]`` is the
    token string of id i, for both sides."""
    require("ctranslate2", "the ctranslate2 format")
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    if len(vocab) != cfg.vocab_size:
        raise ValueError(f"{len(vocab)} token strings for a vocabulary of {cfg.vocab_size}")
    pre = cfg.norm == "pre"
    d_head = engine_head_size(cfg)
    # head_dim only where d_model / heads is not the head size: the spec stays as before.
    head_dim = None if cfg.heads * d_head == cfg.d_model else d_head
    relu = common_spec.Activation.RELU
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(cfg.encoder_layers, cfg.heads, pre_norm=pre,
                                                activation=relu, head_dim=head_dim),
        transformer_spec.TransformerDecoderSpec(cfg.decoder_layers, cfg.heads, pre_norm=pre,
                                                activation=relu, head_dim=head_dim))
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    sd = {k: v.numpy().copy() for k, v in tensors.items()}

    def linear(s, name: str) -> None:
        s.weight, s.bias = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def attention(s, name: str, cross: bool) -> None:  # heads of d_head (engine_attention)
        a = {k: (w.numpy().copy(), b.numpy().copy())
             for k, (w, b) in engine_attention(tensors, name, cfg, cross).items()}
        fused = [["q"], ["k", "v"]] if cross else [["q", "k", "v"]]
        for target, parts in zip(s.linear, fused + [["out"]], strict=True):
            target.weight = np.concatenate([a[x][0] for x in parts])
            target.bias = np.concatenate([a[x][1] for x in parts])

    def norm(s, name: str) -> None:
        s.gamma, s.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    emb = sd["embedding.weight"]
    positions = model.positions.detach().float().cpu().numpy().copy()
    for side in (spec.encoder, spec.decoder):
        table = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        table.weight = emb
        side.scale_embeddings = True  # x sqrt(d_model), Section 3.4
        side.position_encodings.encodings = positions
    for i, ls in enumerate(spec.encoder.layer):
        p = f"encoder.{i}"
        attention(ls.self_attention, f"{p}.self_attn", cross=False)
        norm(ls.self_attention.layer_norm, f"{p}.res_attn.norm")
        linear(ls.ffn.linear_0, f"{p}.ffn.w1")
        linear(ls.ffn.linear_1, f"{p}.ffn.w2")
        norm(ls.ffn.layer_norm, f"{p}.res_ffn.norm")
    for i, ls in enumerate(spec.decoder.layer):
        p = f"decoder.{i}"
        attention(ls.self_attention, f"{p}.self_attn", cross=False)
        norm(ls.self_attention.layer_norm, f"{p}.res_self.norm")
        attention(ls.attention, f"{p}.cross_attn", cross=True)
        norm(ls.attention.layer_norm, f"{p}.res_cross.norm")
        linear(ls.ffn.linear_0, f"{p}.ffn.w1")
        linear(ls.ffn.linear_1, f"{p}.ffn.w2")
        norm(ls.ffn.layer_norm, f"{p}.res_ffn.norm")
    if pre:
        norm(spec.encoder.layer_norm, "encoder_norm")
        norm(spec.decoder.layer_norm, "decoder_norm")
    spec.decoder.projection.weight = emb  # the tied output matrix
    spec.decoder.projection.bias = output_bias(model).numpy()
    spec.config.layer_norm_epsilon = 1e-5
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = BOS, EOS, UNK
    spec.config.decoder_start_token = BOS
    spec.config.add_source_bos = spec.config.add_source_eos = False
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    return spec


def write_ctranslate2(model: Transformer, vocab: list[str], directory: Path,
                      quantization: str = "none") -> Path:
    """Convert ``model`` into the existing folder ``directory`` (model.bin, config.json,
    shared_vocabulary.json). Not atomic by itself: :func:`export` wraps it."""
    if quantization not in QUANTIZATIONS:
        raise DataError(f"--quantization {quantization!r}: choose one of "
                        f"{', '.join(QUANTIZATIONS)}")
    spec = ctranslate2_spec(model, vocab)
    spec.validate()
    spec.optimize(quantization="float32" if quantization == "none" else quantization)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(str(directory))
    return directory


def save_ctranslate2(model: Transformer, vocab: list[str], directory: Path,
                     quantization: str = "none") -> Path:
    """:func:`write_ctranslate2` into ``directory`` as one atomic folder (for the benchmarks
    and tests, which have a model and a vocabulary but no `aiayn average` folder)."""
    with atomic_path(directory, directory=True) as tmp:
        write_ctranslate2(model, vocab, tmp, quantization)
    return Path(directory)


# -- transformers (MarianMT) -----------------------------------------------------------------

def hidden_permutation(d_model: int) -> Tensor:
    """perm with Marian's hidden dimension m = our dimension perm[m]: evens, then odds.

    Our sinusoid has sin in even and cos in odd dimensions; Marian's has sin in the first
    half and cos in the second, for the same frequencies in the same order.
    """
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_config(cfg: TransformerConfig) -> dict:
    """``MarianConfig`` keyword arguments that describe ``cfg``."""
    return dict(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function="relu",
        max_position_embeddings=cfg.max_positions, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.activation_dropout,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID, forced_eos_token_id=None,
        architectures=["MarianMTModel"])


def generation_config(cfg: TransformerConfig, beam: int, alpha: float) -> dict:
    """Decoding defaults of the exported model: ours, in transformers' terms."""
    return dict(num_beams=beam, length_penalty=alpha, early_stopping="never",
                max_length=cfg.max_positions, decoder_start_token_id=BOS_ID,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                forced_eos_token_id=None)


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our weights under MarianMTModel's names, hidden dimensions permuted (module docstring).

    The tied copies (encoder/decoder ``embed_tokens``, ``lm_head``) and the sinusoid tables
    (computed by Marian at load) are left out, as ``save_pretrained`` leaves them out.
    """
    cfg = model.cfg
    perm = hidden_permutation(cfg.d_model)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out: dict[str, Tensor] = {"model.shared.weight": sd["embedding.weight"][:, perm]}

    def reads(dst: str, weight: Tensor, bias: Tensor) -> None:  # input from the stream
        out[f"{dst}.weight"], out[f"{dst}.bias"] = weight[:, perm], bias

    def writes(dst: str, src: str) -> None:  # output into the stream
        out[f"{dst}.weight"] = sd[f"{src}.weight"][perm]
        out[f"{dst}.bias"] = sd[f"{src}.bias"][perm]

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = sd[f"{src}.weight"][perm]
        out[f"{dst}.bias"] = sd[f"{src}.bias"][perm]

    def attention(dst: str, src: str, cross: bool) -> None:  # heads of d_model / heads
        a = engine_attention(sd, src, cfg, cross)
        for name in ("q", "k", "v"):
            reads(f"{dst}.{name}_proj", *a[name])
        out_w, out_b = a["out"]
        out[f"{dst}.out_proj.weight"], out[f"{dst}.out_proj.bias"] = out_w[perm], out_b[perm]

    def ffn(dst: str, src: str) -> None:
        reads(f"{dst}.fc1", sd[f"{src}.ffn.w1.weight"], sd[f"{src}.ffn.w1.bias"])
        writes(f"{dst}.fc2", f"{src}.ffn.w2")

    for i in range(cfg.encoder_layers):
        dst, src = f"model.encoder.layers.{i}", f"encoder.{i}"
        attention(f"{dst}.self_attn", f"{src}.self_attn", cross=False)
        norm(f"{dst}.self_attn_layer_norm", f"{src}.res_attn.norm")
        ffn(dst, src)
        norm(f"{dst}.final_layer_norm", f"{src}.res_ffn.norm")
    for i in range(cfg.decoder_layers):
        dst, src = f"model.decoder.layers.{i}", f"decoder.{i}"
        attention(f"{dst}.self_attn", f"{src}.self_attn", cross=False)
        norm(f"{dst}.self_attn_layer_norm", f"{src}.res_self.norm")
        attention(f"{dst}.encoder_attn", f"{src}.cross_attn", cross=True)
        norm(f"{dst}.encoder_attn_layer_norm", f"{src}.res_cross.norm")
        ffn(dst, src)
        norm(f"{dst}.final_layer_norm", f"{src}.res_ffn.norm")
    out["final_logits_bias"] = output_bias(model)[None]
    return out


def to_marian(model: Transformer, beam: int = 4, alpha: float = 0.6) -> Any:
    """A ``MarianMTModel`` (eval mode) that computes ``model``, in memory."""
    check_exportable(model.cfg, "transformers")
    transformers = quiet_transformers()
    config = transformers.MarianConfig(**marian_config(model.cfg))
    marian = transformers.MarianMTModel(config)
    weights = marian_state_dict(model)
    missing, unexpected = marian.load_state_dict(weights, strict=False)
    expected_missing = {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                        "lm_head.weight", "model.encoder.embed_positions.weight",
                        "model.decoder.embed_positions.weight"}
    if unexpected or set(missing) - expected_missing:
        raise RuntimeError(f"MarianMTModel's parameters changed: missing "
                           f"{sorted(set(missing) - expected_missing)}, unexpected {unexpected}")
    marian.tie_weights()
    marian.generation_config = transformers.GenerationConfig(
        **generation_config(model.cfg, beam, alpha))
    return marian.eval()


def fast_tokenizer(tokenizer: Tokenizer, max_positions: int) -> Any:
    """Our tokenizer as a ``PreTrainedTokenizerFast`` that appends EOS to every text."""
    transformers = quiet_transformers()
    from tokenizers import processors

    tok = Tokenizer.from_str(tokenizer.to_str())  # a copy: the post-processor is ours to set
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A $B {EOS}", special_tokens=[(EOS, EOS_ID)])
    # split_special_tokens: "<pad>" in a sentence is text, as our tokenizer reads it
    # (aiayn.data.tokenizer.literal_special_tokens); saved in tokenizer_config.json.
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        model_max_length=max_positions - 1, clean_up_tokenization_spaces=False,
        split_special_tokens=True)


def write_transformers(model: Transformer, tokenizer: Tokenizer, directory: Path,
                       beam: int = 4, alpha: float = 0.6) -> Path:
    """Save ``model`` and ``tokenizer`` as a transformers folder into ``directory`` (exists
    or not). Not atomic by itself: :func:`export` wraps it."""
    marian = to_marian(model, beam, alpha)
    marian.save_pretrained(str(directory), safe_serialization=True)
    fast_tokenizer(tokenizer, model.cfg.max_positions).save_pretrained(str(directory))
    # The generic class name, which transformers 4 and 5 both resolve (5 would write its
    # own alias, unknown to 4).
    config_path = Path(directory) / "tokenizer_config.json"

    config = read_json(config_path)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    write_json(config_path, config)
    return Path(directory)


# -- checking an export against our model ----------------------------------------------------

PROBE_LENGTHS = (11, 5)  # two sources of different lengths: padding is exercised too


def probe(model: Transformer, max_target: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    """Deterministic probe sources (ids, without EOS) and our greedy outputs for them."""

    content = model.cfg.vocab_size - len(SPECIAL_TOKENS)
    # A source with its EOS, and BOS + a target, within the model's positions.
    limit = model.cfg.max_positions - 1
    sources = [[len(SPECIAL_TOKENS) + (7 * i + 3 * n) % content for i in range(n)]
               for n in (min(n, limit) for n in PROBE_LENGTHS)]
    targets = greedy_search(model, source_batch(sources), max_len_a=0.0,
                            max_len_b=min(max_target, limit))
    return sources, targets


@torch.no_grad()
def our_log_probs(model: Transformer, sources: list[list[int]], targets: list[list[int]]
                  ) -> list[list[float]]:
    """Per-token log P of each target + EOS under our decoder (PAD, BOS banned)."""

    was_training = model.training
    model.eval()
    out = []
    for src, tgt in zip(sources, targets, strict=True):
        logits = model(source_batch([src]), torch.tensor([[BOS_ID] + tgt])).float()[0]
        logits[:, list(BANNED_IDS)] = float("-inf")
        lp = F.log_softmax(logits, dim=-1)
        out.append(lp[torch.arange(len(tgt) + 1), torch.tensor(tgt + [EOS_ID])].tolist())
    model.train(was_training)
    return out


def ctranslate2_log_probs(directory: Path, vocab: list[str], sources: list[list[int]],
                          targets: list[list[int]], compute_type: str = "default"
                          ) -> list[list[float]]:
    """Per-token log P of each target + EOS, scored by CTranslate2 from ``directory``."""
    ct2 = require("ctranslate2", "the ctranslate2 format")
    translator = ct2.Translator(str(directory), device="cpu", compute_type=compute_type,
                                intra_threads=1)
    results = translator.score_batch([[vocab[i] for i in s] + [EOS] for s in sources],
                                     [[vocab[i] for i in t] for t in targets],
                                     max_input_length=0)
    return [list(r.log_probs) for r in results]


@torch.no_grad()
def transformers_log_probs(marian: Any, sources: list[list[int]], targets: list[list[int]]
                           ) -> list[list[float]]:
    """Per-token log P of each target + EOS under a MarianMTModel (teacher forcing)."""
    out = []
    for src, tgt in zip(sources, targets, strict=True):
        ids = torch.tensor([src + [EOS_ID]])
        logits = marian(input_ids=ids, attention_mask=torch.ones_like(ids),
                        decoder_input_ids=torch.tensor([[BOS_ID] + tgt])).logits.float()[0]
        lp = F.log_softmax(logits, dim=-1)
        out.append(lp[torch.arange(len(tgt) + 1), torch.tensor(tgt + [EOS_ID])].tolist())
    return out


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if len(x) != len(y):
            return math.inf
        worst = max([worst] + [abs(p - q) for p, q in zip(x, y, strict=True)])
    return worst


def check_export(fmt: str, directory: Path, folder: ModelFolder, quantized: bool) -> float:
    """Load the export back with its engine and score the probe: max |Δ log p| vs ours.

    Raises a DataError above CHECK_TOLERANCE for an unquantized export (a wrong mapping, or
    an engine version that computes otherwise); quantized exports only report theirs.
    """
    sources, targets = probe(folder.model)
    ours = our_log_probs(folder.model, sources, targets)
    if fmt == "ctranslate2":
        vocab = token_strings(folder.tokenizer, folder.cfg.vocab_size)
        theirs = ctranslate2_log_probs(directory, vocab, sources, targets)
    else:
        transformers = quiet_transformers()
        marian = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(directory)).eval()
        theirs = transformers_log_probs(marian, sources, targets)
        fast = transformers.AutoTokenizer.from_pretrained(str(directory))
        text = "A check: does the exported tokenizer give our ids?"
        ids = folder.tokenizer.encode(text, add_special_tokens=False).ids
        if fast(text)["input_ids"] != ids + [EOS_ID]:
            raise DataError(f"{directory}: the exported tokenizer does not encode as ours "
                            "(+ EOS); nothing was written")
    diff = max_difference(ours, theirs)
    if not quantized and not diff <= CHECK_TOLERANCE:
        raise DataError(
            f"the {fmt} export of {folder.path} does not compute our model: per-token "
            f"log-probabilities of a probe differ by up to {diff:.3g} (more than "
            f"{CHECK_TOLERANCE}); nothing was written. This is a bug in aiayn/export/convert.py or "
            f"an engine version it does not know; please report it")
    return diff


# -- the export command ----------------------------------------------------------------------

@dataclass
class ExportResult:
    directory: Path
    fmt: str
    quantization: str
    max_logprob_difference: float
    files: list[str]


def check_request(fmt: str, quantization: str = "none") -> None:
    """Stop before any work on an unknown format or quantization, or a missing package."""
    if fmt not in FORMATS:
        raise DataError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if quantization not in QUANTIZATIONS:
        raise DataError(f"--quantization {quantization!r}: choose one of "
                        f"{', '.join(QUANTIZATIONS)}")
    if fmt == "transformers" and quantization != "none":
        raise DataError(f"--quantization {quantization}: only the ctranslate2 format is "
                        "quantized; the transformers export keeps float32 weights")
    require(fmt, f"the {fmt} format")  # the package is named as the format


def check_out(out: Path, model_dir: Path) -> None:
    """Refuse an ``out`` that replacing as a whole would lose data: the model folder or a
    folder holding it (``--out data``), or an existing folder that is not an earlier export
    (no aiayn.json in it, e.g. ``--out .``)."""
    target, model = Path(out).resolve(), Path(model_dir).resolve()
    if target == model or target in model.parents:
        raise DataError(f"--out {out}: {'is' if target == model else 'holds'} the model folder "
                        f"{model_dir}, and the export replaces --out whole; choose another "
                        "folder (default: data/export/FORMAT)")
    if target.is_dir() and any(target.iterdir()) and not (target / METADATA_FILE).is_file():
        raise DataError(f"--out {out}: an existing folder that is not an export (no "
                        f"{METADATA_FILE} in it), and the export replaces --out whole; choose "
                        "a new folder, or move this one away yourself")


def export(model: Path | ModelFolder, out: Path, fmt: str, *, quantization: str = "none",
           beam: int = 4, alpha: float = 0.6, card: Callable[[float], str] | None = None
           ) -> ExportResult:
    """Export an `aiayn average` folder (a path, or loaded) to ``out`` as one atomic folder.

    ``fmt``: "ctranslate2" (``quantization`` from QUANTIZATIONS) or "transformers" (beam and
    alpha become its generation defaults). ``card``: makes the README.md of the folder from
    the check's largest log-probability difference. An old ``out`` is replaced whole, and
    only after the new export passed its check.
    """
    check_request(fmt, quantization)
    folder = model if isinstance(model, ModelFolder) else load_model_folder(model)
    model_dir = folder.path
    check_exportable(folder.cfg, fmt)
    out = Path(out)
    check_out(out, folder.path)
    with atomic_path(out, directory=True) as tmp:
        if fmt == "ctranslate2":
            vocab = token_strings(folder.tokenizer, folder.cfg.vocab_size)
            write_ctranslate2(folder.model, vocab, tmp, quantization)
        else:
            write_transformers(folder.model, folder.tokenizer, tmp, beam, alpha)
        if fmt == "ctranslate2":  # the transformers folder has its own tokenizer.json
            shutil.copyfile(folder.tokenizer_path, tmp / "tokenizer.json")
        diff = check_export(fmt, tmp, folder, quantized=quantization != "none")
        write_json(tmp / METADATA_FILE, {
            "format": fmt, "quantization": quantization,
            "source": {k: v for k, v in folder.config.items()},
            "check": {"max_abs_logprob_difference": diff,
                      "what": "per-token log P of a probe translation, this export vs aiayn"},
            "length_normalisation": "|Y|^alpha (aiayn translate: --length-norm length)",
        })
        if card is not None:
            write_text(tmp / "README.md", card(diff))
        files = sorted(p.name for p in tmp.iterdir())
    log.info("export: %s (%s%s) -> %s; probe log-probs within %.2g of ours", model_dir, fmt,
             "" if quantization == "none" else f", {quantization}", out, diff)
    return ExportResult(out, fmt, quantization, diff, files)
