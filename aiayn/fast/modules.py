"""The fast variants of the model's layers, and :func:`apply`, which puts them in a built
model.

Each variant subclasses the layer of ``aiayn.model`` it replaces and computes the same with
the kernels of this package; it adds no parameter and no buffer, so :func:`apply` changes
a layer's class in place and the model keeps its parameters (the very tensors: an optimizer
built before or after sees the same ones) and its state dict. The decoder's variants also
run on the real (non-pad) target positions alone (:class:`Packing`), stopping before the
tied projection, for the fused losses that apply it themselves (:mod:`aiayn.fast.loss`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.fast import extension
from aiayn.fast.attention import attention, attention_applies
from aiayn.fast.config import DEFAULTS, KernelConfig
from aiayn.fast.dropout import dropout, eager_dropout
from aiayn.fast.linear import feed_forward, linear, linear_relu
from aiayn.fast.residual import residual_norm, residual_norm_applies
from aiayn.model import DecoderLayer, FeedForward, MultiHeadAttention, Residual, Transformer


@dataclass
class Packing:
    """The real positions of a padded (B, T) batch, for layers that skip the padding.

    Position-wise layers (projections, feed-forward, LayerNorm, dropout) treat every
    position alike, so the decoder can run them on the N real positions alone, (N, d) rows
    in row-major order; attention alone needs the (B, T) layout and gets it from ``pad``
    (zeros at padding: with the causal mask, real queries never see those keys), except the
    CPU attention kernel, which reads and writes the packed rows where ``offsets`` places
    them (no padded copy either way; bench/README.md, "the row kernels on two threads, and
    attention on the decoder's packed rows").
    """

    index: Tensor  # (N,) positions in the flattened (B * T) batch
    batch: int
    length: int
    _offsets: Tensor | None = field(default=None, repr=False)
    _offsets_known: bool = field(default=False, repr=False)

    @staticmethod
    def positions(tokens: Tensor, pad_id: int) -> Tensor:
        """The flat positions of the non-pad tokens (waits for a GPU; loaders know them)."""
        return (tokens.reshape(-1) != pad_id).nonzero().squeeze(1)

    def pad(self, rows: Tensor) -> Tensor:
        """(N, k) → (B, T, k), zeros at padding."""
        out = rows.new_zeros(self.batch * self.length, rows.shape[-1])
        return out.index_copy(0, self.index, rows).view(self.batch, self.length, -1)

    def unpad(self, x: Tensor) -> Tensor:
        """(B, T, k) → (N, k)."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def offsets(self) -> Tensor | None:
        """Where each sequence's rows start in the packed rows, and where the last ends:
        int64 (B + 1), when every sequence's real positions are its first ones (padding at
        the end, as the loaders make batches), so that sequence b holds packed rows
        offsets[b] .. offsets[b + 1]; else None. Computed once (CPU only: the attention
        kernel that reads packed rows is a CPU one)."""
        if not self._offsets_known:
            self._offsets_known = True
            if self.index.device.type == "cpu":
                row = torch.div(self.index, self.length, rounding_mode="floor")
                counts = torch.bincount(row, minlength=self.batch)
                ends = counts.cumsum(0)
                rank = torch.arange(self.index.numel()) - (ends - counts)[row]
                if torch.equal(self.index - row * self.length, rank):
                    self._offsets = torch.cat([ends.new_zeros(1), ends])
        return self._offsets


class FastLinear(nn.Linear):
    """``nn.Linear`` whose product is :func:`aiayn.fast.linear.linear`."""

    kernel_config: KernelConfig = DEFAULTS

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.kernel_config)


class FastDropout(nn.Dropout):
    """``nn.Dropout`` whose masks come from :func:`aiayn.fast.dropout.dropout` on a CPU. On a
    GPU ``F.dropout`` is one fused kernel (mask and output together) where the int16 masks
    take five, so it stays there unless ``KernelConfig.int16_dropout_on_cuda``; compiled,
    it becomes Inductor's own fused random mask."""

    kernel_config: KernelConfig = DEFAULTS

    def forward(self, x: Tensor) -> Tensor:
        if (not torch.compiler.is_compiling()
                and (x.device.type != "cuda" or self.kernel_config.int16_dropout_on_cuda)):
            return dropout(x, self.p, self.training)
        return super().forward(x)


class FastMultiHeadAttention(MultiHeadAttention):
    """Multi-head attention with the fast linear layers and dropout masks, on a CPU in fp32
    or under bf16 autocast (up to ``KernelConfig.attention_kernel_keys`` keys for the dtype)
    in one C++ pass straight from the projections' layout
    (:func:`aiayn.fast.attention.attention`), and on the decoder's packed rows."""

    kernel_config: KernelConfig = DEFAULTS
    weights_dropout = staticmethod(eager_dropout)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, causal: bool = False,
                memory: Tensor | None = None, kv: tuple[Tensor, Tensor] | None = None,
                cache: dict | None = None, need_weights: bool = False, group: int = 1,
                packing: Packing | None = None) -> tuple[Tensor, Tensor | None]:
        """:meth:`MultiHeadAttention.forward`; with ``packing``, x is its (N, d) rows, and so
        is the output."""
        if self._takes_kernel(x, memory, mask, causal, kv, cache, need_weights, group,
                              packing):
            return self._attend_in_one_pass(x, memory, mask, causal, packing), None
        if packing is None:
            return super().forward(x, mask=mask, causal=causal, memory=memory, kv=kv,
                                   cache=cache, need_weights=need_weights, group=group)
        # projections on the real rows, attention on the (B, T) layout
        out, weights = self.attend_heads(packing.pad(self.project(x)), mask, causal, memory,
                                         kv, cache, need_weights, group)
        return self.out_proj(packing.unpad(out)), weights

    def _attend_in_one_pass(self, x: Tensor, memory: Tensor | None, mask: Tensor | None,
                            causal: bool, packing: Packing | None) -> Tensor:
        projected = self.project(x)
        kv = self.kv_proj(memory) if self.cross else None
        # packed rows in and out where Packing.offsets places them: no padded copy
        offsets = None if packing is None else packing.offsets()
        packed = None if offsets is None else (offsets, packing.length)
        if packing is not None and packed is None:
            projected = packing.pad(projected)
        out = attention(projected, kv, self.heads, self.d_k, self.d_v, mask, causal,
                        self.dropout if self.training else 0.0, packed=packed)
        if packing is not None and packed is None:
            out = packing.unpad(out)
        return self.out_proj(out)

    def _takes_kernel(self, x: Tensor, memory: Tensor | None, mask: Tensor | None,
                      causal: bool, kv, cache, need_weights: bool, group: int,
                      packing: Packing | None) -> bool:
        """Whether the C++ pass computes this call: no cache, no weights asked for, and
        :func:`aiayn.fast.attention.attention_applies` for autocast's dtype (else x's)."""
        if kv is not None or cache is not None or need_weights or group != 1:
            return False
        dtype = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                 else x.dtype)
        if self.cross:
            keys = memory.shape[1]
        else:
            keys = packing.length if packing is not None else x.shape[1]
        return attention_applies(x.device, dtype, keys, mask, causal, self.kernel_config)


class FastFeedForward(FeedForward):
    """The FFN as :func:`aiayn.fast.linear.feed_forward` (one function on padded rows under
    CPU autocast, the ReLU fused into the first product), or with activation dropout in
    training as the fast linear layers apart."""

    kernel_config: KernelConfig = DEFAULTS

    def forward(self, x: Tensor) -> Tensor:
        w1, w2, config = self.w1, self.w2, self.kernel_config
        if not (self.training and self.activation_dropout.p):
            return feed_forward(x, w1.weight, w1.bias, w2.weight, w2.bias, config)
        return w2(self.activation_dropout(linear_relu(x, w1.weight, w1.bias, config)))


class FastResidual(Residual):
    """Post-LN in training on a CPU: dropout, the sum and LayerNorm in one C++ pass each way
    (:func:`aiayn.fast.residual.residual_norm`), the same math and keep rule as
    :class:`FastDropout`'s masks."""

    kernel_config: KernelConfig = DEFAULTS

    def add(self, x: Tensor, out: Tensor) -> Tensor:
        if (not self.pre_norm and self.training
                and residual_norm_applies(x, out, self.norm.weight, self.kernel_config)):
            return residual_norm(x, out, self.norm.weight, self.norm.bias, self.dropout.p,
                                 self.norm.eps)
        return super().add(x, out)


class FastDecoderLayer(DecoderLayer):
    """A decoder layer that also runs on the (N, d) real rows of a :class:`Packing`."""

    def forward(self, y: Tensor, memory: Tensor | None, src_mask: Tensor, *,
                packing: Packing | None = None, **decoding):
        if packing is None:
            return super().forward(y, memory, src_mask, **decoding)
        attend_self = functools.partial(self.self_attn, causal=True, packing=packing)
        attend_cross = functools.partial(self.cross_attn, mask=src_mask, memory=memory,
                                         packing=packing)
        y, _ = self.res_self(y, attend_self)
        y, _ = self.res_cross(y, attend_cross)
        y, _ = self.res_ffn(y, lambda h: (self.ffn(h), None))
        return y, None, None


class FastTransformer(Transformer):
    """The model whose forward also runs the decoder on the real target positions alone."""

    def forward(self, src: Tensor, tgt_in: Tensor, *, hidden: bool = False,
                packed: Tensor | None = None) -> Tensor:
        """:meth:`Transformer.forward`; with ``packed``, the flat positions of the real
        (non-pad) tokens of ``tgt_in`` (:meth:`Packing.positions`), the decoder's output at
        those positions only, (N, d) rows, computed without the padding."""
        if packed is None:
            return super().forward(src, tgt_in, hidden=hidden)
        memory = self.encode(src)
        mask = self.source_mask(src)
        packing = Packing(packed, *tgt_in.shape)
        y = packing.unpad(self.embed(tgt_in))
        for layer in self.decoder:
            y, _, _ = layer(y, memory, mask, packing=packing)
        return self.decoder_norm(y)


# Each layer of the model and its fast variant (exact classes: a variant is never swapped).
VARIANTS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: FastLinear, nn.Dropout: FastDropout, MultiHeadAttention: FastMultiHeadAttention,
    FeedForward: FastFeedForward, Residual: FastResidual, DecoderLayer: FastDecoderLayer,
    Transformer: FastTransformer,
}


def apply(model: Transformer, config: KernelConfig = DEFAULTS) -> Transformer:
    """Give a built ``model`` the fast kernels with ``config``, in place, and return it.

    Every layer with a fast variant takes its class (:data:`VARIANTS`); parameters, buffers,
    the state dict and the training mode stay as they are. Applied again, the config is
    replaced. On a CPU the C++ extension is built (or loaded from torch's cache) now, so
    that its one-time build is not paid inside the first training step."""
    for module in model.modules():
        if (variant := VARIANTS.get(type(module))) is not None:
            module.__class__ = variant
        if hasattr(type(module), "kernel_config"):
            module.kernel_config = config
    if config.cpu_extension and model.embedding.weight.device.type == "cpu":
        extension.cpu_extension()
    return model
