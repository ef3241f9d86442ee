"""Training (Section 5): what trains a model.

- ``loop``: the training loop (the Trainer, its steps, validation and checkpoints);
- ``build``: what a run is built from (model, data, objective, optimizer, run store);
- ``clock``: the run's clock and its checkpoint rule;
- ``resume``: going on from a checkpoint.

Nothing is imported here: the decoders and the exporter read model files through this
package without loading the trainer.
"""
