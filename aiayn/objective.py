"""What training optimises (Section 5.3-5.4): label-smoothed cross-entropy, and Adam on the
paper's warmup schedule (aiayn.schedule: the rate, the cooldown).

``train.rdrop`` (0 in the paper: off) adds R-Drop's consistency term to the loss (Liang
et al. 2021, "R-Drop: Regularized Dropout for Neural Networks"): see :func:`rdrop_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.schedule import noam_lr


def make_optimizer(model: nn.Module, betas: tuple[float, float], eps: float, d_model: int,
                   warmup_steps: int, scale: float, fused: bool = False
                   ) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam whose learning rate follows :func:`noam_lr` through a LambdaLR scheduler.

    The base lr is 1 and the schedule returns the absolute rate; the scheduler has taken k
    steps after k optimizer steps, so step k+1 uses noam_lr(k + 1). ``fused`` selects
    torch's fused Adam kernel (CPU and CUDA; one kernel over all parameters, 5.5 against
    20 ms per step for the multi30k model on 2 CPU cores); otherwise torch's default
    (a loop over parameters on CPU, ``foreach`` on CUDA). The state dict is the same.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=betas, eps=eps,
                                 fused=True if fused else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: noam_lr(k + 1, d_model, warmup_steps, scale))
    return optimizer, scheduler


def label_smoothed_loss(logits: Tensor, labels: Tensor, epsilon: float, pad_id: int
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Sum over non-pad labels of the label-smoothed loss and of the plain NLL.

    Section 5.4: label smoothing of value epsilon; the target distribution puts
    1 - epsilon on the reference token and spreads epsilon uniformly over the vocabulary
    (as ``F.cross_entropy(label_smoothing=epsilon)``). Padding positions count for nothing.
    Returns (smoothed loss sum, NLL sum, number of non-pad labels); log-probabilities are
    computed in fp32 even under bf16 autocast. The count is a 0-dim tensor on the logits'
    device, so that computing the loss never waits for a GPU; ``int(n)`` reads it.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])  # (N, V)
    flat = labels.reshape(-1)
    real = flat != pad_id
    nll = -lprobs.gather(1, flat.unsqueeze(1)).squeeze(1)  # (N,)
    uniform = -lprobs.mean(dim=-1)                            # (N,)
    loss = (1.0 - epsilon) * nll + epsilon * uniform
    return loss.masked_fill(~real, 0.0).sum(), nll.masked_fill(~real, 0.0).sum(), real.sum()


def rdrop_loss(logits: Tensor, labels: Tensor, epsilon: float, alpha: float
               ) -> tuple[Tensor, Tensor]:
    """R-Drop's loss sums over the N labels of a batch that went through the model twice,
    with independent dropout: ``logits`` (2, N, V), the two passes' logits at the labels'
    positions; ``labels`` (N,), none of them padding.

    Per label, with p1, p2 the two passes' output distributions and LS the label-smoothed
    loss of :func:`label_smoothed_loss`:

        (LS(p1) + LS(p2)) / 2  +  alpha * (KL(p1 || p2) + KL(p2 || p1)) / 4

    the ratio of fairseq's ``label_smoothed_cross_entropy_with_rdrop`` (both copies'
    smoothed losses summed, plus alpha times half the two KL sums) on a per-label scale, so
    that the first term is what a plain step's loss measures. Returns (that sum, the mean
    of the two passes' NLL sums); log-probabilities in fp32.
    """
    if logits.dim() != 3 or logits.shape[0] != 2 or logits.shape[1] != labels.numel():
        raise ValueError(f"rdrop_loss wants logits (2, N, V) for N = {labels.numel()} labels, "
                         f"got {tuple(logits.shape)}")
    lprobs = F.log_softmax(logits.float(), dim=-1)                       # (2, N, V)
    index = labels.reshape(1, -1, 1).expand(2, -1, 1)
    nll = -lprobs.gather(2, index).squeeze(2).sum(1)                     # (2,)
    uniform = -lprobs.mean(dim=-1).sum(1)                                # (2,)
    smoothed = (1.0 - epsilon) * nll + epsilon * uniform
    # KL(p1 || p2) + KL(p2 || p1) = sum (p1 - p2) (log p1 - log p2)
    both_kl = ((lprobs[0].exp() - lprobs[1].exp()) * (lprobs[0] - lprobs[1])).sum()
    return smoothed.sum() / 2 + alpha * both_kl / 4, nll.sum() / 2
