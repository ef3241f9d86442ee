"""The typed schema of ``params.yaml``.

Every stage loads the parameters once through :func:`load_params`; the library below
never reads ``params.yaml`` itself. An unknown key, a wrong type or an impossible value
stops the stage before any work with a message naming the key, the value and what is
allowed (:class:`aiayn.errors.ParamsError`).

Defaults are the paper's (Vaswani et al., 2017) where the paper says something; the
committed ``params.yaml`` is the small demo preset composed from ``conf/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from aiayn.errors import ParamsError

# Languages the corpus sources know how to name. WMT14 pairs English with these.
Language = Literal["cs", "de", "en", "fr", "hi", "ru"]
SPLITS = ("train", "valid", "test")


class Strict(BaseModel):
    """Base for every section: unknown keys are errors, values are validated on assignment,
    and a number's key refuses true/false (pydantic's lax mode reads them as 1/0, so YAML's
    `encoder_layers: yes` would train one layer)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _wants_numbers(field.annotation) and (
                isinstance(value, bool) or isinstance(value, (list, tuple))
                and any(isinstance(v, bool) for v in value)):
            raise ValueError("wants a number, not true/false (YAML reads true/false, yes/no "
                             "and on/off as booleans); write the number")
        return value


def _wants_numbers(annotation: Any) -> bool:
    """Whether a field holds a number or a list/tuple of numbers (never a bool)."""
    if annotation in (int, float):
        return True
    args = [a for a in get_args(annotation) if a is not type(None) and a is not Ellipsis]
    return get_origin(annotation) in (list, tuple, Union, UnionType) and bool(args) and all(
        a in (int, float) for a in args)


class SplitNames(Strict):
    """How the source names our three splits."""

    train: str = "train"
    valid: str = "validation"
    test: str = "test"


class ToySource(Strict):
    """The built-in synthetic English→German-like task (see ``aiayn.data.toy``)."""

    train_pairs: int = Field(20_000, gt=0)
    valid_pairs: int = Field(500, gt=0)
    test_pairs: int = Field(500, gt=0)
    min_words: int = Field(3, ge=1)
    max_words: int = Field(40, ge=1)
    seed: int = 1

    @model_validator(mode="after")
    def _lengths(self) -> ToySource:
        if self.min_words > self.max_words:
            raise ValueError(
                f"min_words ({self.min_words}) must not exceed max_words ({self.max_words})"
            )
        return self


class HubSource(Strict):
    """A dataset on the Hugging Face hub with rows ``{"translation": {lang: text}}``."""

    path: str = "wmt/wmt14"
    name: str | None = "de-en"
    revision: str | None = None
    splits: SplitNames = SplitNames(train="train", valid="validation", test="test")


class LocalSource(Strict):
    """A folder of line-aligned plain-text files, e.g. ``train.en`` / ``train.de``."""

    dir: str = "data/corpus"
    # File name of one side of one split; {split} is the name from `splits`, {lang} a language.
    pattern: str = "{split}.{lang}"
    splits: SplitNames = SplitNames(train="train", valid="valid", test="test")

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, pattern: str) -> str:
        for key in ("{split}", "{lang}"):
            if key not in pattern:
                raise ValueError(f"must contain {key}, e.g. '{{split}}.{{lang}}'")
        # The pattern is a str.format template: any other field ({x}, {0}), an unmatched brace
        # or a bad format spec would fail only when the download stage names the files.
        try:
            pattern.format(split="train", lang="en")
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
            what = (f"unknown placeholder {{{exc.args[0]}}}" if isinstance(exc, KeyError)
                    else "a positional placeholder {}" if isinstance(exc, IndexError)
                    else str(exc))
            raise ValueError(
                f"not a valid file-name template ({what}); only {{split}} and {{lang}} may "
                "appear in braces (write a literal brace as {{ or }}), e.g. '{split}.{lang}.gz'"
            ) from None
        return pattern


class Cleaning(Strict):
    """Which pairs the download stage drops (each drop is counted by reason)."""

    max_words: int = Field(250, gt=0, description="drop a pair if either side has more words")
    max_ratio: float = Field(
        3.0, ge=1.0, description="drop a pair if the longer side has > ratio x the words"
    )
    clean_test: bool = Field(
        False, description="also filter valid/test (off: the test set is scored as published)"
    )


class DataConfig(Strict):
    source: Literal["toy", "hub", "local"] = "toy"
    src_lang: Language = "en"
    tgt_lang: Language = "de"
    toy: ToySource = ToySource()
    hub: HubSource = HubSource()
    local: LocalSource = LocalSource()
    clean: Cleaning = Cleaning()

    @model_validator(mode="after")
    def _direction(self) -> DataConfig:
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"src_lang and tgt_lang are both {self.src_lang!r}; pick two")
        if self.source == "toy" and {self.src_lang, self.tgt_lang} != {"en", "de"}:
            raise ValueError(
                f"the toy source speaks en and de only, not {self.src_lang}-{self.tgt_lang}"
            )
        if self.source == "hub" and self.hub.name and "-" in self.hub.name:
            pair = set(self.hub.name.split("-"))
            if {self.src_lang, self.tgt_lang} != pair:
                raise ValueError(
                    f"hub config {self.hub.name!r} holds {sorted(pair)}, "
                    f"not {self.src_lang}-{self.tgt_lang}"
                )
        return self

    @property
    def languages(self) -> tuple[str, str]:
        return (self.src_lang, self.tgt_lang)


class VocabConfig(Strict):
    # Not "size": DVC leaves keys named "size" out of its run-cache key (see test_config).
    vocab_size: int = Field(37_000, ge=300, description="BPE vocabulary size incl. specials")
    min_frequency: int = Field(2, ge=1)
    max_pairs: int = Field(
        0, ge=0, description="train BPE on an evenly spread sample of this many train pairs; "
        "0 uses them all")


class SurveyConfig(Strict):
    max_len_candidates: list[int] = Field(default_factory=lambda: [64, 128, 256, 512])
    bins: int = Field(60, gt=0)

    @model_validator(mode="after")
    def _positive(self) -> SurveyConfig:
        if not self.max_len_candidates or min(self.max_len_candidates) <= 0:
            raise ValueError("max_len_candidates must be a non-empty list of positive lengths")
        return self


class ShardConfig(Strict):
    max_tokens: int = Field(
        4096,
        gt=0,
        description="tokens per batch on each side, padding included, of the plan the shard "
        "stage stores and reports (metrics/shard.json: batches, padding); training plans its "
        "own micro-batches from the same sorted pairs (train.tokens_per_step, "
        "train.max_tokens and the process count)",
    )
    max_len: int = Field(256, gt=0, description="pairs with a longer side (in tokens) are dropped")
    shard_tokens: int = Field(
        50_000_000, gt=0, description="upper bound on tokens per shard file pair"
    )

    @model_validator(mode="after")
    def _fits(self) -> ShardConfig:
        # +2: each sequence carries bos/eos; the longest allowed pair must fit in one batch.
        if self.max_len + 2 > self.max_tokens:
            raise ValueError(
                f"max_len ({self.max_len}) + 2 special tokens exceeds max_tokens "
                f"({self.max_tokens}): the longest pair could never be batched"
            )
        return self


class ModelConfig(Strict):
    """Table 3 of the paper: base is d_model 512, 6+6 layers, 8 heads, d_ff 2048, dropout 0.1."""

    d_model: int = Field(512, gt=0)
    heads: int = Field(8, gt=0)
    encoder_layers: int = Field(6, gt=0)
    decoder_layers: int = Field(6, gt=0)
    d_ff: int = Field(2048, gt=0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    norm: Literal["post", "pre"] = "post"
    max_positions: int = Field(1024, gt=0, description="rows of the position table: the "
                               "longest sequence (tokens with BOS/EOS) the model reads or writes")
    d_k: int = Field(0, description="Section 3.2.2: dimensions of one head's queries and keys; "
                     "0: d_model / heads (the paper's base). Table 3 (A), (B)")
    d_v: int = Field(0, description="dimensions of one head's values; 0: d_model / heads")
    positions: Literal["sinusoidal", "learned"] = Field(
        "sinusoidal", description="Section 3.5: sinusoidal (the paper), or learned positional "
        "embeddings (Table 3 row (E)): max_positions x d_model more parameters")
    position_init_std: float = Field(
        0.0, ge=0.0, description="with positions: learned, the standard deviation of their "
        "normal initialisation; 0: d_model^-1/2, as fairseq and tensor2tensor (then they start "
        "at 1/sqrt(d_model) of the scaled token embeddings' size); 0.71 is the sinusoids' own "
        "size (1/sqrt(2) per dimension)")
    output_vocab: Literal["shared", "target"] = Field(
        "shared", description="shared: the softmax spans the whole shared vocabulary (the "
        "paper, Section 3.4); target: only the tokens that occur on the target side of the "
        "train and valid shards, the same tied matrix's rows (fewer products where the "
        "shared vocabulary holds many source-only tokens)")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.position_init_std and self.positions != "learned":
            raise ValueError(
                f"position_init_std ({self.position_init_std:g}) sets how learned positions "
                f"start, but positions is {self.positions!r}; set positions: learned, or "
                "position_init_std: 0")
        for name in ("d_k", "d_v"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive, or 0 for "
                                 f"d_model / heads ({self.d_model} / {self.heads})")
        if (not self.d_k or not self.d_v) and self.d_model % self.heads:
            # Where one of d_k, d_v is set, say why the other still needs the division.
            unset = [n for n in ("d_k", "d_v") if not getattr(self, n)]
            why = (f" ({unset[0]} 0 means d_model / heads; set it too to keep these heads)"
                   if len(unset) == 1 else "")
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by heads ({self.heads}); "
                f"e.g. heads={_divisor_hint(self.d_model, self.heads)}{why}"
            )
        return self


def _divisor_hint(n: int, near: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - near))


class TrainConfig(Strict):
    """Section 5: optimizer, schedule, regularisation, batching; plus checkpointing."""

    tokens_per_step: int = Field(
        25_000, gt=0, description="target tokens per optimizer step across all processes and "
        "machines, whatever their number: each process's micro-batches are planned for it "
        "when training starts (aiayn/data/batching.py)")
    max_tokens: int = Field(
        0, ge=0, description="the most tokens one process's micro-batch may hold per side, "
        "padding included (a GPU's memory); 0: one micro-batch per process a step, of "
        "tokens_per_step / processes (the fastest where it fits). Otherwise accumulation = "
        "ceil(tokens_per_step / (processes * max_tokens)) micro-batches of equal size")
    steps: int = Field(100_000, gt=0)
    warmup_steps: int = Field(4000, gt=0)
    lr_scale: float = Field(1.0, gt=0, description="lr = scale * d^-0.5 * min(s^-0.5, s*w^-1.5)")
    cooldown: float = Field(
        0.0, ge=0.0, le=1.0, description="fraction of training at its end over which the lr "
        "falls linearly to zero, the end being train.steps or, with train.max_minutes, the "
        "time budget, whichever comes first; 0: the paper's schedule to the last step")
    label_smoothing: float = Field(0.1, ge=0.0, lt=1.0)
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = Field(1e-9, gt=0)
    clip_norm: float = Field(0.0, ge=0, description="gradient-norm clipping; 0 turns it off")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast on a GPU or CPU with native bf16 (Ampere+; "
        "AVX512-BF16, AMX, Arm BF16), fp32 elsewhere; bf16 forces autocast; fp16: float16 "
        "autocast with dynamic loss scaling, for GPUs without bf16 (V100, T4, P100)")
    kernels: Literal["fast", "plain"] = Field(
        "fast", description="fast: the fused output-projection loss, cheaper dropout masks and "
        "fused Adam (aiayn/fast/), the same math with fewer passes over memory; plain: "
        "torch's own operators, readable against the paper")
    compile: bool = False
    max_minutes: float = Field(
        0.0, ge=0, description="training time budget over all sessions of a run; when spent, "
        "training stops at a checkpoint (0: no budget, train.steps decides)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    allocator: Literal["auto", "glibc", "tcmalloc", "jemalloc"] = Field(
        "auto", description="the C heap of CPU training (aiayn/training/memory.py): auto: "
        "tcmalloc, else jemalloc, where installed (`aiayn train` re-launches itself with it "
        "preloaded), else glibc's malloc trimmed every few steps; on a GPU auto keeps glibc")
    nproc_per_node: int = Field(1, gt=0, description="processes per machine under torchrun")
    max_restarts: int = Field(
        0, ge=0, description="with nproc_per_node > 1: how often torchrun restarts the group "
        "after a process dies (each restart resumes from the last checkpoint)")
    log_every: int = Field(50, gt=0, description="steps between train-loss log lines")
    valid_every: int = Field(500, gt=0, description="steps between validation passes")
    checkpoint_every_steps: int = Field(0, ge=0, description="0: by time only")
    checkpoint_every_minutes: float = Field(10.0, ge=0, description="0: by steps only")
    keep_checkpoints: int = Field(10, gt=0)
    average_last: int = Field(5, gt=0, description="checkpoints averaged by the average stage")
    average: Literal["last", "best"] = Field(
        "last", description="last: the last train.average_last checkpoints (the paper); best: "
        "the train.average_last with the best validation BLEU, chosen among the checkpoints "
        "written at validation-BLEU steps (needs train.valid_bleu_every, a multiple of "
        "train.checkpoint_every_steps)")
    average_candidates: list[int] = Field(
        [], description="counts of checkpoints the average stage tries, keeping the one "
        "whose average scores the best validation BLEU (the valid set decoded as "
        "train.valid_bleu_sentences, _beam and _alpha say); train.average_last is then "
        "not used. The best count depends on how far training got: a run stopped early by "
        "its time budget still improves fast at its end, and averaging older checkpoints "
        "costs BLEU; [] (the default): average train.average_last, no choice")
    valid_bleu_every: int = Field(
        0, ge=0, description="steps between validation-BLEU passes: the valid set translated "
        "with the current weights and scored with sacreBLEU; 0: off")
    valid_bleu_sentences: int = Field(
        0, ge=0, description="translate only the first N valid sentences; 0: all")
    valid_bleu_beam: int = Field(
        4, gt=0, description="beam size of validation BLEU (1: greedy); its own, so that "
        "changing decode.* re-runs decoding, not training")
    valid_bleu_alpha: float = Field(0.6, ge=0.0, description="its GNMT length penalty")
    # Not in the paper; left at 0 they are off. See aiayn/model.py.
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    activation_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    subword_split: float = Field(
        0.0, ge=0.0, lt=1.0, description="probability that a merged BPE token of a training "
        "batch is replaced by the two tokens it was merged from (again for each part), a new "
        "segmentation each epoch; a subword regulariser after BPE-dropout (aiayn/data/subword.py). "
        "Validation and decoding keep the plain segmentation; 0: off")
    rdrop: float = Field(
        0.0, ge=0.0, description="R-Drop's weight alpha (Liang et al. 2021): each training "
        "batch goes through the model twice with independent dropout, and the loss adds "
        "alpha/4 times the two passes' KL divergences, both ways, per target token "
        "(aiayn/training/objective.py, rdrop_loss); a step costs about twice as much; 0: off")
    rdrop_start: float = Field(
        0.0, ge=0.0, lt=1.0, description="with train.rdrop, the fraction of training after "
        "which R-Drop is on, measured as train.cooldown measures it (the steps of train.steps "
        "or, with train.max_minutes, the time budget, whichever is further on): the steps "
        "before it are plain ones at half the cost; 0: R-Drop from the first step")
    rdrop_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="with train.rdrop, the share of each batch's "
        "sentences that go through the model a second time (a new random draw each step): "
        "their tokens get R-Drop's loss, the others the plain one; a step costs about "
        "1 + rdrop_fraction plain ones; 1: the whole batch, as in the paper")

    @model_validator(mode="after")
    def _average(self) -> TrainConfig:
        if self.rdrop_start > 0 and self.rdrop == 0:
            raise ValueError(f"rdrop_start is {self.rdrop_start:g} but rdrop is 0: R-Drop is "
                             "off, so there is nothing to start; set train.rdrop (e.g. 5) or "
                             "leave rdrop_start at 0")
        if self.rdrop_fraction < 1 and self.rdrop == 0:
            raise ValueError(f"rdrop_fraction is {self.rdrop_fraction:g} but rdrop is 0: R-Drop "
                             "is off, so no sentence goes through twice; set train.rdrop "
                             "(e.g. 5) or leave rdrop_fraction at 1")
        if not self.average_candidates and self.average_last > self.keep_checkpoints:
            raise ValueError(
                f"average_last ({self.average_last}) exceeds keep_checkpoints "
                f"({self.keep_checkpoints}); keep at least as many checkpoints as you average")
        if any(n <= 0 for n in self.average_candidates):
            raise ValueError(f"average_candidates {self.average_candidates}: every count must "
                             "be at least 1")
        if self.average_candidates and max(self.average_candidates) > self.keep_checkpoints:
            raise ValueError(
                f"average_candidates {self.average_candidates} holds "
                f"{max(self.average_candidates)}, more than keep_checkpoints "
                f"({self.keep_checkpoints}); keep at least as many checkpoints as you average")
        if self.average == "best":
            if not self.valid_bleu_every:
                raise ValueError("average is 'best' but valid_bleu_every is 0: the best "
                                 "checkpoints are those with the best validation BLEU; set "
                                 "valid_bleu_every (e.g. to checkpoint_every_steps)")
            # Only scored checkpoints can be chosen, so every validation-BLEU step must
            # write one; checkpoints in between are simply never chosen.
            if not self.checkpoint_every_steps or \
                    self.valid_bleu_every % self.checkpoint_every_steps:
                raise ValueError(
                    f"average is 'best', so every validation-BLEU step must write a checkpoint: "
                    f"valid_bleu_every ({self.valid_bleu_every}) must be a multiple of "
                    f"checkpoint_every_steps ({self.checkpoint_every_steps}, 0 = by time only); "
                    + (f"set valid_bleu_every to {self.checkpoint_every_steps} or a multiple of it"
                       if self.checkpoint_every_steps else
                       f"set checkpoint_every_steps, e.g. to {self.valid_bleu_every}"))
        if not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ValueError(f"adam_betas {self.adam_betas} must lie in [0, 1)")
        return self


class DecodeConfig(Strict):
    """Section 6.1: beam 4, length penalty alpha 0.6, max output length = input + 50."""

    beam: int = Field(4, gt=0)
    alpha: float = Field(0.6, ge=0.0)
    max_len_a: float = Field(1.0, ge=0.0)
    max_len_b: int = Field(50, ge=0)
    batch_size: int = Field(128, gt=0, description="sentences decoded together")


class Params(Strict):
    seed: int = Field(1, ge=0)  # numpy's generators take no negative seed
    data: DataConfig = DataConfig()
    vocab: VocabConfig = VocabConfig()
    survey: SurveyConfig = SurveyConfig()
    shard: ShardConfig = ShardConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    decode: DecodeConfig = DecodeConfig()

    @model_validator(mode="after")
    def _positions(self) -> Params:
        if self.train.max_tokens and self.train.max_tokens < self.shard.max_len + 1:
            raise ValueError(
                f"train.max_tokens ({self.train.max_tokens}) cannot hold a pair of "
                f"shard.max_len ({self.shard.max_len}) tokens and its special token; raise it "
                f"to at least {self.shard.max_len + 1}, or 0 for one micro-batch per process")
        if self.shard.max_len + 2 > self.model.max_positions:
            learned = ("; with model.positions 'learned' the model holds one learned row per "
                       "position, so max_positions must cover the longest sequence"
                       if self.model.positions == "learned" else "")
            raise ValueError(
                f"shard.max_len ({self.shard.max_len}) + 2 exceeds model.max_positions "
                f"({self.model.max_positions}){learned}; raise model.max_positions to "
                f"{self.shard.max_len + 2} or lower shard.max_len to "
                f"{self.model.max_positions - 2}"
            )
        return self


# --------------------------------------------------------------------------- what each affects


@dataclass(frozen=True)
class Affects:
    """What a parameter (or a whole section) affects: the stages that read it, and whether
    it shapes the steps of a training run."""

    stages: tuple[str, ...]
    # Part of a training run's identity: a checkpoint resumes only while every such value
    # is unchanged (a changed one sets the run aside and a new one starts). The run's
    # length, logging, checkpointing, device, process count and validation are not: a
    # longer or re-logged run is the same run.
    shapes_training: bool = False


TRAINS = Affects(("train",), shapes_training=True)
RUNS_TRAINING = Affects(("train",))  # the train stage reads it, its steps do not depend on it
AVERAGING = ("average", "score")  # score too: its MLflow run is the experiment's own
VALIDATION_BLEU = Affects(("train", "average"))  # training's curve, the average's choice

# Every parameter and what it affects, declared once. A key names a setting or a whole
# section, as dvc.yaml's `params:` lists name them: each stage there lists exactly the keys
# declared for it here (tests/test_config.py checks, also that every setting is covered),
# and a training run's identity is the values of the keys that shape training
# (aiayn.training.run_store.run_identity).
PARAM_EFFECTS: dict[str, Affects] = {
    "seed": TRAINS,
    "data.source": Affects(("download",)),
    "data.hub": Affects(("download",)),
    "data.local": Affects(("download",)),
    "data.toy": Affects(("download",)),
    "data.clean": Affects(("download",)),
    # the direction: which side is encoded, which is scored (export names it in its card)
    "data.src_lang": Affects(("survey", "shard", "train", "average", "translate", "export")),
    "data.tgt_lang": Affects(("survey", "shard", "train", "average", "translate", "score",
                              "export")),
    "vocab": Affects(("vocab",)),
    "survey": Affects(("survey",)),
    "shard": Affects(("shard",)),
    "model": TRAINS,
    "train.tokens_per_step": TRAINS,
    # how a step is split into micro-batches, as the process count: a run goes on under another
    "train.max_tokens": RUNS_TRAINING,
    "train.steps": RUNS_TRAINING,  # a longer run resumes (with a cooldown: from its branch point)
    "train.warmup_steps": TRAINS,
    "train.lr_scale": TRAINS,
    "train.cooldown": TRAINS,
    "train.label_smoothing": TRAINS,
    "train.adam_betas": TRAINS,
    "train.adam_eps": TRAINS,
    "train.clip_norm": TRAINS,
    "train.precision": TRAINS,
    "train.kernels": TRAINS,
    "train.compile": RUNS_TRAINING,
    "train.max_minutes": RUNS_TRAINING,
    "train.device": RUNS_TRAINING,
    "train.allocator": RUNS_TRAINING,
    "train.nproc_per_node": RUNS_TRAINING,
    "train.max_restarts": RUNS_TRAINING,
    "train.log_every": RUNS_TRAINING,
    "train.valid_every": RUNS_TRAINING,
    "train.checkpoint_every_steps": RUNS_TRAINING,
    "train.checkpoint_every_minutes": RUNS_TRAINING,
    "train.keep_checkpoints": RUNS_TRAINING,
    "train.average_last": Affects(AVERAGING),
    "train.average": Affects(AVERAGING),
    "train.average_candidates": Affects(AVERAGING),
    "train.valid_bleu_every": RUNS_TRAINING,
    "train.valid_bleu_sentences": VALIDATION_BLEU,
    "train.valid_bleu_beam": VALIDATION_BLEU,
    "train.valid_bleu_alpha": VALIDATION_BLEU,
    "train.attention_dropout": TRAINS,
    "train.activation_dropout": TRAINS,
    "train.subword_split": TRAINS,
    "train.rdrop": TRAINS,
    "train.rdrop_start": TRAINS,
    "train.rdrop_fraction": TRAINS,
    "decode": Affects(("translate", "score")),
    # validation BLEU while training and the average's candidates decode in batches of it
    "decode.batch_size": VALIDATION_BLEU,
    "decode.beam": Affects(("export",)),  # the exported model's default decoding
    "decode.alpha": Affects(("export",)),
}


def stage_params(stage: str) -> list[str]:
    """The parameter keys ``stage`` reads (dvc.yaml's ``params:`` list for it)."""
    return [key for key, affects in PARAM_EFFECTS.items() if stage in affects.stages]


def declared_effects(key: str) -> Affects:
    """What the setting ``key`` (dotted, e.g. ``train.lr_scale``) affects: its own
    declaration or its section's."""
    name = key
    while name:
        if name in PARAM_EFFECTS:
            return PARAM_EFFECTS[name]
        name = name.rpartition(".")[0]
    raise KeyError(f"{key!r} is not declared in aiayn.config.PARAM_EFFECTS")


def shapes_training(key: str) -> bool:
    """Whether the setting ``key`` (dotted, e.g. ``train.lr_scale``) shapes a training run's
    steps: its own declaration or its section's."""
    return declared_effects(key).shapes_training


AFTER_TRAINING = frozenset({"average", "translate", "score", "export"})


def after_training(key: str) -> bool:
    """Whether the setting ``key`` is read after training only (averaging, decoding,
    scoring, export): a changed value re-runs later stages on the same training run."""
    try:
        return set(declared_effects(key).stages) <= AFTER_TRAINING
    except KeyError:
        return False


def flatten(d: dict | None, prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: ``{"model": {"d_model": 512}}`` becomes
    ``{"model.d_model": 512}``."""
    out: dict[str, Any] = {}
    for key, value in (d or {}).items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _format_location(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-after"))


def _lookup(raw: Any, loc: tuple[Any, ...]) -> Any:
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return None
    return node


# YAML 1.1 (PyYAML) reads 1e5 and 1.0e5 as text: a float needs a dot and a signed exponent.
_E_NOTATION = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _plain(x: float) -> str:
    """x as YAML reads a number: 100000 for 1e5 (a float key takes "1e-9" as text anyway)."""
    return str(int(x)) if x.is_integer() and abs(x) < 1e15 else f"{x:.1e}"


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    """Validate a parsed YAML mapping; raise ParamsError naming key, value and rule."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: the top level must be a mapping of sections, not {raw!r}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = _format_location(err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                lines.append(
                    f"{key}: unknown key (value {err['input']!r}); remove it or fix its "
                    "spelling — see conf/config.yaml for every known key"
                )
            else:
                value = _lookup(raw, err["loc"])
                # A rule about a whole section names its values itself.
                shown = f" = {value!r}" if value is not None and not isinstance(value, dict) else ""
                if isinstance(value, str) and _E_NOTATION.fullmatch(value.strip()):
                    msg += (f" (YAML reads {value} as text: e-notation needs a dot and a "
                            f"signed exponent; write {_plain(float(value))})")
                lines.append(f"{key}{shown}: {msg}")
        # One line, whatever the number of problems (a log or a CI summary keeps it whole).
        head = f"{source}: " if len(lines) == 1 else f"{source}: {len(lines)} invalid parameters: "
        raise ParamsError(head + " | ".join(" ".join(x.split()) for x in lines)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML would keep the
    last silently, and a stage would run with a value the user may not have meant)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one section (lines "
                    f"{seen[key] + 1} and {key_node.start_mark.line + 1}); keep one",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate a params file; every stage calls this once, before any work."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(
            f"{path}: no such params file; run from the repository root or pass --params PATH"
        )
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError:
        raise ParamsError(f"{path}: not UTF-8 text; re-create it with `aiayn params "
                          "<preset>`") from None
    if raw is None:
        raise ParamsError(f"{path}: empty; compose it with `aiayn params <preset>` (e.g. "
                          "`aiayn params demo`)")
    return parse_params(raw, str(path))
