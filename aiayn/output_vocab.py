"""The output vocabulary (``model.output_vocab: target``): the tokens the softmax spans.

A vocabulary shared by two languages holds many tokens that never occur on the target side.
Their rows of the shared matrix still embed the source, but the projection, the largest
product of a small model, can skip them: the model saves a logit bias (0 at the spanned
tokens, -inf elsewhere; :meth:`aiayn.model.Transformer.set_output_vocab`), and the loss,
decoding and export read the spanned tokens from it as one :class:`OutputVocab`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class OutputVocab:
    """The tokens the softmax spans (``model.output_vocab: target``): their ids (ascending),
    each token's column among them (-1: not spanned) and the padding id's column (the loss's
    pad label; -1 where the padding id is not spanned, which only decoding allows). Made by
    :meth:`Transformer.output_vocab` from the model's saved logit bias."""

    ids: Tensor
    column: Tensor
    pad: int

    @classmethod
    def of(cls, ids: Tensor, vocab_size: int, pad_id: int) -> OutputVocab:
        ids = ids.long()
        column = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        column[ids] = torch.arange(ids.numel(), device=ids.device)
        return cls(ids, column, int(column[pad_id]))

    @staticmethod
    def bias_of(ids: Tensor, vocab_size: int) -> Tensor:
        """The model's logit bias for a softmax that spans the tokens ``ids``: 0 there, -inf
        elsewhere (fp32, on ``ids``' device)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"output token ids must be a non-empty subset of 0.."
                             f"{vocab_size - 1}")
        bias = torch.full((vocab_size,), float("-inf"), device=ids.device)
        bias[ids] = 0.0
        return bias

    def rows(self, weight: Tensor) -> Tensor:
        """The spanned tokens' rows of the shared matrix: the projection onto them."""
        return weight.index_select(0, self.ids)

    def loss_labels(self, tokens: Tensor) -> tuple[Tensor, int]:
        """Target ids as columns of the spanned softmax, and the padding's column (the labels
        the loss skips)."""
        if self.pad < 0:
            raise ValueError("the output vocabulary must hold the padding id, the label the "
                             "loss skips")
        return self.column[tokens], self.pad

    def logit_bias(self, vocab_size: int) -> Tensor:
        """0 at the spanned tokens, -inf elsewhere, over the whole vocabulary (CPU, fp32)."""
        return self.bias_of(self.ids.cpu(), vocab_size)
