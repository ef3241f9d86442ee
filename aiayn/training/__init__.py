"""Training (Section 5): the loop (:mod:`.loop`), what it is built from (:mod:`.build`), its
clock and checkpoint rule (:mod:`.clock`) and resuming (:mod:`.resume`)."""

from aiayn.training.build import build_trainer, device_kind, model_config, target_vocabulary
from aiayn.training.loop import (
    OutOfMemory,
    RunState,
    Trainer,
    TrainingDiverged,
    TrainingListener,
    TrainPaths,
)

__all__ = ["OutOfMemory", "RunState", "Trainer", "TrainPaths", "TrainingDiverged",
           "TrainingListener", "build_trainer", "device_kind", "model_config",
           "target_vocabulary"]
