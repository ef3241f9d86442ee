"""What training optimises (Section 5.3-5.4): label-smoothed cross-entropy, and Adam on the
paper's warmup schedule (aiayn.training.schedule: the rate, the cooldown).

``train.rdrop`` (0 in the paper: off) adds R-Drop's consistency term to the loss (Liang
et al. 2021, "R-Drop: Regularized Dropout for Neural Networks"): see :func:`rdrop_loss`.

A step's loss on a batch is a criterion, as fairseq's: one object chosen once from the
params (:func:`make_criterion`), called as ``criterion(net, batch)``. Label-smoothed
cross-entropy on the full logits (``train.kernels: plain``) or fused with the tied output
projection on the decoder's real positions (``fast``: :mod:`aiayn.fast`); R-Drop on top
of either.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast import KernelConfig, Packing, projected_label_smoothed_loss, projected_rdrop_loss
from aiayn.output_vocab import OutputVocab
from aiayn.training.schedule import noam_lr


def make_optimizer(model: nn.Module, betas: tuple[float, float], eps: float, d_model: int,
                   warmup_steps: int, scale: float, fused: bool = False
                   ) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
    """Adam whose learning rate follows :func:`noam_lr` through a LambdaLR scheduler.

    The base lr is 1 and the schedule returns the absolute rate; the scheduler has taken k
    steps after k optimizer steps, so step k+1 uses noam_lr(k + 1). ``fused`` selects
    torch's fused Adam kernel (CPU and CUDA; one kernel over all parameters, several times
    faster than the loop: bench/README.md, "the fast kernels"); otherwise torch's default
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


# --------------------------------------------------------------------------- criteria

# (smoothed loss sum, NLL sum, labels): what every criterion returns for a batch; the count
# may be a device tensor, so that computing the loss never waits for a GPU.
LossSums = tuple[Tensor, Tensor, "int | Tensor"]


@dataclass(kw_only=True)
class LabelSmoothedCrossEntropy:
    """Section 5.4 on the full logits: ``criterion(net, batch)`` for ``net`` (the model or
    its compiled or DDP wrapper) and a batch on the device. With ``output``
    (model.output_vocab: target) the softmax, and label smoothing's uniform share, span its
    tokens only: their columns of the full logits. ``amp_dtype``: the autocast dtype of
    the forward (None: fp32)."""

    label_smoothing: float
    pad_id: int
    amp_dtype: torch.dtype | None = None
    output: OutputVocab | None = None

    def labels(self, batch) -> tuple[Tensor, int]:
        """The batch's labels and their padding id, in the output vocabulary's ids."""
        if self.output is None:
            return batch.tgt_out, self.pad_id
        return self.output.loss_labels(batch.tgt_out)

    def autocast(self, batch) -> contextlib.AbstractContextManager:
        return torch.autocast(batch.src.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)

    def positions(self, batch) -> Tensor:
        """The flat positions of the batch's labels (the loader found them on the host)."""
        if batch.tgt_positions is not None:
            return batch.tgt_positions
        return Packing.positions(batch.tgt_out, self.pad_id)

    def logits(self, net: nn.Module, src: Tensor, tgt_in: Tensor) -> Tensor:
        logits = net(src, tgt_in)
        return logits if self.output is None else logits.index_select(-1, self.output.ids)

    def __call__(self, net: nn.Module, batch) -> LossSums:
        labels, label_pad = self.labels(batch)
        with self.autocast(batch):
            logits = self.logits(net, batch.src, batch.tgt_in)
        return label_smoothed_loss(logits, labels, self.label_smoothing, label_pad)


@dataclass(kw_only=True)
class FusedLabelSmoothedCrossEntropy(LabelSmoothedCrossEntropy):
    """The same loss computed by the fast kernels: the decoder on the real target positions
    only (``pack``; False: on the padded batch, whose products' shapes repeat when the
    batch's do) and the tied projection onto ``embedding`` (the model's shared matrix; with
    ``output`` its rows of the output vocabulary) inside
    :func:`aiayn.fast.projected_label_smoothed_loss`, in ``blocks`` (chunk rows, softmax
    rows; None: the device's, :func:`aiayn.fast.loss_blocks`), with the kernels' ``config``
    (the one the model's fast layers take, :func:`aiayn.fast.apply`)."""

    embedding: Tensor
    blocks: tuple[int, int] | None = None
    pack: bool = True
    config: KernelConfig = field(default_factory=KernelConfig)

    def weight(self) -> Tensor:
        return self.embedding if self.output is None else self.output.rows(self.embedding)

    def __call__(self, net: nn.Module, batch) -> LossSums:
        labels, label_pad = self.labels(batch)
        with self.autocast(batch):
            positions = self.positions(batch)
            rows = (net(batch.src, batch.tgt_in, packed=positions) if self.pack
                    else net(batch.src, batch.tgt_in, hidden=True))
            chunk_rows, softmax_rows = self.blocks or (None, None)
            return projected_label_smoothed_loss(rows, self.weight(), labels,
                                                 self.label_smoothing, label_pad,
                                                 positions=positions, chunk_rows=chunk_rows,
                                                 softmax_rows=softmax_rows, config=self.config)


@dataclass(kw_only=True)
class RDrop:
    """R-Drop on top of ``base``: with gradients on, the batch goes through the net twice in
    one call, stacked on itself so that each copy draws its own dropout, and the loss is
    :func:`rdrop_loss` of the two passes (``alpha``: train.rdrop). Without gradients
    (validation, where dropout is off) or while not ``active`` (train.rdrop_start's point not
    yet reached) ``base``'s loss.

    ``fraction`` (train.rdrop_fraction) < 1 sends only that share of the batch's sentences
    through a second time (:meth:`subset`): their labels get :func:`rdrop_loss`, the others
    ``base``'s plain label-smoothed loss, summed over the batch's labels as before; a step
    costs about 1 + fraction plain ones instead of 2."""

    base: LabelSmoothedCrossEntropy
    alpha: float
    active: bool = True
    fraction: float = 1.0

    def subset(self, batch) -> Tensor | None:
        """The sentences (rows of the batch) that go through twice, in order: None for all
        of them, else round(fraction x sentences) of them, at least one, drawn anew each
        step from torch's global generator (dropout's, so a seeded run draws them alike)."""
        sentences = batch.src.shape[0]
        m = max(1, round(self.fraction * sentences))
        if m >= sentences:
            return None
        return torch.randperm(sentences)[:m].sort().values.to(batch.src.device)

    def doubled(self, batch, subset: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """The batch with ``subset``'s sentences (None: all) stacked under it, the flat
        positions of the labels the net is to give rows for (every first-copy label, then
        the second copies'), the first copies' labels (N,), and which of those N have a
        second copy (None: all; else their indices, in the order of the second copies)."""
        positions = self.base.positions(batch)
        labels, _ = self.base.labels(batch)
        kept = labels.reshape(-1).index_select(0, positions)
        if subset is None:
            flat = batch.tgt_out.numel()
            return (torch.cat([batch.src, batch.src]), torch.cat([batch.tgt_in, batch.tgt_in]),
                    torch.cat([positions, positions + flat]), kept, None)
        sentences, length = batch.tgt_out.shape
        sentence = positions // length
        slot = torch.searchsorted(subset, sentence)            # the sentence's place in subset
        inside = subset.index_select(0, slot.clamp(max=subset.numel() - 1)) == sentence
        paired = inside.nonzero().squeeze(1)
        second = ((sentences + slot.index_select(0, paired)) * length
                  + positions.index_select(0, paired) % length)
        return (torch.cat([batch.src, batch.src.index_select(0, subset)]),
                torch.cat([batch.tgt_in, batch.tgt_in.index_select(0, subset)]),
                torch.cat([positions, second]), kept, paired)

    @staticmethod
    def unpaired(paired: Tensor, n: int) -> Tensor:
        """The indices in [0, n) that ``paired`` leaves out, in order."""
        alone = torch.ones(n, dtype=torch.bool, device=paired.device)
        alone[paired] = False
        return alone.nonzero().squeeze(1)

    def split(self, rows: Tensor, kept: Tensor, paired: Tensor
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``rows`` as :meth:`doubled` lays them out (one per first-copy label, then one per
        second copy) split between the two losses: the paired labels' rows, first copies
        then second copies (2M, ...), their labels (M,), the unpaired labels' rows and
        their labels."""
        n = kept.numel()
        first, alone = rows[:n], self.unpaired(paired, n)
        return (torch.cat([first.index_select(0, paired), rows[n:]]),
                kept.index_select(0, paired), first.index_select(0, alone),
                kept.index_select(0, alone))

    def __call__(self, net: nn.Module, batch) -> LossSums:
        if not (self.active and torch.is_grad_enabled()):
            return self.base(net, batch)
        src, tgt_in, both, kept, paired = self.doubled(batch, self.subset(batch))
        n = kept.numel()
        with self.base.autocast(batch):
            logits = self.base.logits(net, src, tgt_in)                    # (B + M, T, V)
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, both)
        if paired is None:
            loss, nll = rdrop_loss(logits.view(2, n, logits.shape[-1]), kept,
                                   self.base.label_smoothing, self.alpha)
            return loss, nll, n
        pairs, pair_labels, alone, alone_labels = self.split(logits, kept, paired)
        loss, nll = rdrop_loss(pairs.view(2, -1, pairs.shape[-1]), pair_labels,
                               self.base.label_smoothing, self.alpha)
        plain, plain_nll, _ = label_smoothed_loss(alone, alone_labels,
                                                  self.base.label_smoothing, pad_id=-1)
        return loss + plain, nll + plain_nll, n


@dataclass(kw_only=True)
class FusedRDrop(RDrop):
    """R-Drop with the fused loss (:func:`aiayn.fast.projected_rdrop_loss`): the decoder on
    both copies' real positions, the tied projection inside the loss, the default blocks;
    with ``fraction`` < 1 the unpaired labels through the fused label-smoothed loss."""

    base: FusedLabelSmoothedCrossEntropy

    def __call__(self, net: nn.Module, batch) -> LossSums:
        if not (self.active and torch.is_grad_enabled()):
            return self.base(net, batch)
        src, tgt_in, both, kept, paired = self.doubled(batch, self.subset(batch))
        n = kept.numel()
        weight, eps, config = self.base.weight(), self.base.label_smoothing, self.base.config
        with self.base.autocast(batch):
            rows = net(src, tgt_in, packed=both)                            # (N + N', d)
            if paired is None:
                return projected_rdrop_loss(rows, weight, kept, eps, self.alpha, config=config)
            pairs, pair_labels, alone, alone_labels = self.split(rows, kept, paired)
            loss, nll, _ = projected_rdrop_loss(pairs, weight, pair_labels, eps, self.alpha,
                                                config=config)
            plain, plain_nll, _ = projected_label_smoothed_loss(
                alone, weight, alone_labels, eps, -1,
                positions=torch.arange(alone_labels.numel(), device=rows.device), config=config)
        return loss + plain, nll + plain_nll, n


def make_criterion(*, kernels: str, label_smoothing: float, rdrop: float, pad_id: int,
                   embedding: Tensor, rdrop_fraction: float = 1.0,
                   amp_dtype: torch.dtype | None = None,
                   output: OutputVocab | None = None, blocks: tuple[int, int] | None = None,
                   pack: bool = True, config: KernelConfig | None = None
                   ) -> LabelSmoothedCrossEntropy | RDrop:
    """The criterion of ``train.kernels`` (``fast``: fused, ``plain``: on full logits) and
    ``train.rdrop`` (> 0: R-Drop on top, on ``rdrop_fraction`` of each batch's sentences).
    ``blocks``, ``pack`` and ``config`` (None: the default :class:`KernelConfig`): the fused
    loss's (see :class:`FusedLabelSmoothedCrossEntropy`; R-Drop's fused loss takes the
    default blocks)."""
    common = {"label_smoothing": label_smoothing, "pad_id": pad_id, "amp_dtype": amp_dtype,
              "output": output}
    if kernels == "fast":
        fused = FusedLabelSmoothedCrossEntropy(**common, embedding=embedding, blocks=blocks,
                                               pack=pack, config=config or KernelConfig())
        return (FusedRDrop(base=fused, alpha=rdrop, fraction=rdrop_fraction) if rdrop > 0
                else fused)
    plain = LabelSmoothedCrossEntropy(**common)
    return RDrop(base=plain, alpha=rdrop, fraction=rdrop_fraction) if rdrop > 0 else plain
