"""Training (Section 5): what trains a model and keeps its run.

- ``loop``: the training loop (the Trainer, its steps, validation and checkpoints);
- ``build``: what a run is built from (model, data, objective, optimizer, run store);
- ``objective``: label-smoothed cross-entropy (R-Drop on top), and Adam;
- ``schedule``: the learning rate (warmup, inverse square root, cooldown), without torch;
- ``clock``: the run's clock and its checkpoint rule;
- ``checkpoint``: checkpoint files, their averaging and the model folder written from them;
- ``averaging``: a run's last (or best) checkpoints, checked and averaged into a model folder;
- ``run_store``: a run's checkpoint folder and its policy (identity, recovery, space);
- ``run_log``: a run's log rows (training steps and validation passes);
- ``resume``: going on from a checkpoint;
- ``distributed``: torch.distributed as torchrun sets it up;
- ``memory``: the C heap of CPU training (another allocator, or glibc's trimmed).

Nothing is imported here: the decoders and the exporter read model files through this
package, and the stages that plan runs its schedule, without loading the trainer.
"""
