"""The fast training step (``train.kernels: fast``): the paper's model and loss computed with
fewer passes over memory, applied to a built model by one call, as torchtitan applies its
optimisations to a plain model::

    model = fast.apply(Transformer(cfg).to(device), KernelConfig())

:func:`apply` swaps the model's layers for variants that compute the same (and changes no
parameter: the state dict is the same either way); the fused losses take the same
:class:`KernelConfig`. Every tuning constant is a field of that config. ``plain`` keeps
torch's own operators, readable against the paper (``aiayn/model.py``,
``aiayn/training/objective.py``). What each kernel does and why, by module (measurements:
bench/README.md, the sections each module names; ``bench/train_throughput.py`` measures the
step):

* :mod:`~aiayn.fast.loss`: the tied output projection and the label-smoothed loss (and
  R-Drop's) in one pass over the vocabulary, chunk by chunk, gradients formed in forward,
  padding never projected; the softmax in one C++ pass per row under CPU bf16 autocast;
* :mod:`~aiayn.fast.dropout`: dropout masks from 16 random bits per element;
* :mod:`~aiayn.fast.linear`: fp32 products on a CPU through oneDNN; under CPU autocast
  products on row counts that recur (oneDNN builds a primitive per new shape), and the FFN
  in one function on its padded rows;
* :mod:`~aiayn.fast.residual`: the post-LN residual block in one C++ pass each way;
* :mod:`~aiayn.fast.attention`: attention over short sequences in one C++ pass per
  (sequence, head) on a CPU; on CUDA, SDPA without cuDNN's per-shape plans
  (:func:`avoid_cudnn_attention`, a step of its own: plain runs take it too);
* :mod:`~aiayn.fast.modules`: the layers that call them, the decoder on the real target
  positions only (:class:`Packing`), and :func:`apply`;
* :mod:`~aiayn.fast.extension`: the C++ kernels' build (``csrc/cpu_kernels.cpp``).
"""

from aiayn.fast.attention import avoid_cudnn_attention
from aiayn.fast.config import KernelConfig
from aiayn.fast.extension import EXTENSION_ENV
from aiayn.fast.loss import loss_blocks, projected_label_smoothed_loss, projected_rdrop_loss
from aiayn.fast.modules import Packing, apply

__all__ = ["EXTENSION_ENV", "KernelConfig", "Packing", "apply", "avoid_cudnn_attention",
           "loss_blocks", "projected_label_smoothed_loss", "projected_rdrop_loss"]
