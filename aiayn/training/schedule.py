"""The learning-rate schedule (Section 5.3), without torch: what a run's rate will be is
known from its params alone, so the stages that plan runs (``aiayn table3``) can say it.

lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)     (paper, eq. 3)

scaled by ``lr_scale`` (1 in the paper). Steps count from 1, as in the paper.

``train.cooldown`` (0 in the paper) multiplies it by a linear fall to zero over the last
part of training (a "cooldown": Hagele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations"), which suits runs stopped by a step count or a
time budget long before the inverse square root has brought the rate down. With
``train.rdrop_start`` the end also decides from which step R-Drop trains: :func:`schedule_at`
says both for a step, and :func:`end_independent` whether a run's steps so far are the same
under any end (where a run whose end moved goes on from).

:func:`aiayn.training.objective.make_optimizer` drives Adam with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiayn.config import ModelConfig, TrainConfig


def noam_lr(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, then 1/sqrt(step)."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def peak_lr(d_model: int, warmup_steps: int, scale: float, steps: int) -> float:
    """The highest rate :func:`noam_lr` reaches in a run of ``steps`` steps: at the end of
    the warmup, or at the last step of a run that ends inside it."""
    return noam_lr(min(warmup_steps, max(steps, 1)), d_model, warmup_steps, scale)


# The paper's base model peaks at 512^-0.5 * 4000^-0.5 = 7.0e-4 (big: 4.9e-4), and its 6 + 6
# post-LN layers train there. Table 3 on Multi30k (docs/results/multi30k/table3/README.md):
# at the multi30k preset's 2.55e-3, 3 + 3 and 4 + 4 post-LN layers train, 8 + 8 do not (the
# valid loss stays at the unigram level, then diverges), and 8 + 8 train at 0.3x that rate.
PAPER_BASE_PEAK_LR = 512 ** -0.5 * 4000 ** -0.5
DEEP_POST_LN_LAYERS = 5      # more layers than have been seen to train at a high rate
HIGH_PEAK_LR = 2 * PAPER_BASE_PEAK_LR


def deep_post_ln_warning(model: ModelConfig, train: TrainConfig) -> str | None:
    """A warning, with the fixes, when a post-LN stack of 5 or more layers (either side)
    trains at a peak rate above twice the paper's base's (1.4e-3): deep post-LN
    Transformers are known to fail at high rates (Liu et al. 2020, "Understanding the
    Difficulty of Training Transformers"), and 8 + 8 layers did at the multi30k preset's.
    None otherwise. A warning, not an error: where the line lies depends on the data,
    the warmup and the batch."""
    deepest = max(model.encoder_layers, model.decoder_layers)
    peak = peak_lr(model.d_model, train.warmup_steps, train.lr_scale, train.steps)
    if model.norm != "post" or deepest < DEEP_POST_LN_LAYERS or peak <= HIGH_PEAK_LR:
        return None
    safe = PAPER_BASE_PEAK_LR / peak * train.lr_scale
    return (f"train: {model.encoder_layers} + {model.decoder_layers} post-LN layers "
            f"(model.norm: post) at a peak learning rate of {peak:.2e}, "
            f"{peak / PAPER_BASE_PEAK_LR:.1f}x the paper's base ({PAPER_BASE_PEAK_LR:.1e}): "
            "deep post-LN stacks may not train at such a rate (8 + 8 layers stalled, then "
            "diverged, at the multi30k preset's 2.55e-3: docs/results/multi30k/table3/"
            f"README.md). To be safe, set train.lr_scale to {safe:.2g} (the paper's peak), "
            "raise train.warmup_steps, or use model.norm: pre")


def cooldown_factor(progress: float, cooldown: float) -> float:
    """The lr multiplier when a fraction ``progress`` of training is done: 1 until the last
    ``cooldown`` of it, then falling linearly to 0 at the end (1 throughout if cooldown is 0).
    """
    if cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))


def training_progress(t, step: int, elapsed_s: float) -> float:
    """How much of the run is done after ``step`` steps and ``elapsed_s`` seconds: the steps
    taken of train.steps, or the time spent of train.max_minutes if further on."""
    progress = step / t.steps
    if t.max_minutes:
        progress = max(progress, elapsed_s / (60 * t.max_minutes))
    return progress


def schedule_at(t, step: int, elapsed_s: float) -> dict:
    """What the run's end decides for the step after ``step`` steps and ``elapsed_s``
    seconds: ``lr_factor``, train.cooldown's lr multiplier, and ``rdrop_started``, whether
    the run is past train.rdrop_start, so that the step trains with R-Drop (always False
    when R-Drop is off or runs from the first step: nothing then depends on the end). Like
    the cooldown's fall, R-Drop begins with the first step taken past its point."""
    progress = training_progress(t, step, elapsed_s)
    return {"lr_factor": cooldown_factor(progress, t.cooldown),
            "rdrop_started": bool(t.rdrop > 0 and t.rdrop_start > 0
                                  and progress > t.rdrop_start)}


def end_independent(schedule: dict) -> bool:
    """Whether a run's steps so far are those any end would give it: its cooldown has not
    begun and R-Drop has not been switched on by train.rdrop_start (a checkpoint's recorded
    ``schedule`` without the lr multiplier: no)."""
    return schedule.get("lr_factor") == 1.0 and not schedule.get("rdrop_started")
