"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), Section 3.

Readable top to bottom against the paper:

* 3.1  encoder and decoder stacks of N identical layers; each sub-layer is wrapped as
       LayerNorm(x + Dropout(Sublayer(x)))  (post-LN, the paper) or, as an option,
       x + Dropout(Sublayer(LayerNorm(x)))  (pre-LN, with a final LayerNorm per stack);
* 3.2  multi-head scaled dot-product attention (h heads, queries and keys of d_k, values of
       d_v dimensions; d_k = d_v = d_model / h unless set apart, as Table 3 rows (A), (B)), through
       ``torch.nn.functional.scaled_dot_product_attention`` (fused kernels where available;
       under CPU bf16 autocast fp32 scores and softmax written out, see :func:`attend`),
       with an explicit path that also returns the attention weights for plots;
* 3.3  position-wise feed-forward network  max(0, xW1 + b1)W2 + b2;
* 3.4  one weight matrix shared by the source embedding, the target embedding and the
       pre-softmax projection; embeddings multiplied by sqrt(d_model); as an option
       (``output_vocab="target"``) the projection keeps only the rows of the tokens that
       occur on the target side (:meth:`Transformer.set_output_vocab`);
* 3.5  sinusoidal positional encodings, or (``positions="learned"``, Table 3 row (E))
       learned positional embeddings as in ConvS2S [9];
* 5.4  dropout on every sub-layer output and on the sums of embeddings and positions.

The model knows nothing of files or tokenizers. Decoding uses ``encode`` once per source
and ``decode_step`` per target token with a key/value cache (self-attention keys/values
grow by one position per step; cross-attention keys/values are computed once).

``Transformer(cfg, fast=True)`` (chosen at construction, passed down to every layer) draws
dropout masks with ``aiayn.kernels.dropout`` (the same distribution, cheaper) and multiplies
fp32 linear layers on CPU with ``aiayn.kernels.linear``; in training on a CPU, its post-LN
residual blocks run dropout, the sum and LayerNorm as one kernel (``aiayn.kernels.residual_norm``);
``forward(..., packed=positions)`` runs the decoder's position-wise layers on the real
(non-pad) target positions only (:class:`Packing`) and stops before the tied projection, for
losses that apply it themselves (``aiayn.kernels``). These serve the fast training step
(``train.kernels: fast``) and change no parameter: the state dict is the same either way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import kernels


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int = 512
    heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # residual and embedding dropout, Section 5.4
    # Not in the paper (which names only residual dropout); tensor2tensor later added both.
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    norm: str = "post"  # "post" as the paper, or "pre"
    max_positions: int = 1024  # rows of the position table (learned: parameters)
    # Section 3.2.2: per head, queries and keys of d_k and values of d_v dimensions; 0 (the
    # paper's base): d_model / heads. Table 3 (A) varies heads at constant heads * d_k, (B)
    # shrinks d_k alone. 0 is kept as 0, so that a model saved before these fields existed
    # has the same configuration (and run identity) as one saved after.
    d_k: int = 0
    d_v: int = 0
    # Section 3.5: "sinusoidal" (the paper), or "learned" (Table 3 row (E)).
    positions: str = "sinusoidal"
    # Learned positions start ~ N(0, position_init_std); 0: d_model^-1/2 (fairseq's and
    # tensor2tensor's), the token embeddings' own before their sqrt(d) scaling.
    position_init_std: float = 0.0
    pad_id: int = 0
    # "shared": the softmax spans the whole shared vocabulary (the paper, Section 3.4);
    # "target": only the tokens of the target side (Transformer.set_output_vocab).
    output_vocab: str = "shared"

    def __post_init__(self) -> None:
        if self.d_k < 0 or self.d_v < 0:
            raise ValueError(f"d_k ({self.d_k}) and d_v ({self.d_v}) must be positive, or 0 "
                             "for d_model / heads")
        if (not self.d_k or not self.d_v) and self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads}) "
                             "where d_k or d_v is left at d_model / heads")
        if self.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', not "
                             f"{self.positions!r}")
        if self.position_init_std < 0:
            raise ValueError(f"position_init_std ({self.position_init_std}) must be positive, "
                             "or 0 for d_model^-1/2")
        if self.norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', not {self.norm!r}")
        if self.output_vocab not in ("shared", "target"):
            raise ValueError(f"output_vocab must be 'shared' or 'target', not "
                             f"{self.output_vocab!r}")

    @property
    def key_size(self) -> int:
        """d_k, the dimensions of one head's queries and keys."""
        return self.d_k or self.d_model // self.heads

    @property
    def value_size(self) -> int:
        """d_v, the dimensions of one head's values."""
        return self.d_v or self.d_model // self.heads

    @classmethod
    def base(cls, vocab_size: int, **kw) -> TransformerConfig:
        """Table 3, base: N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1."""
        return cls(vocab_size=vocab_size, **kw)

    @classmethod
    def big(cls, vocab_size: int, **kw) -> TransformerConfig:
        """Table 3, big: N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3."""
        return cls(vocab_size=vocab_size, d_model=1024, d_ff=4096, heads=16,
                   dropout=kw.pop("dropout", 0.3), **kw)

    def to_dict(self) -> dict:
        return asdict(self)


def sinusoidal_positions(length: int, d_model: int) -> Tensor:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64)
                         * (-math.log(10000.0) / d_model))
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * inv_freq)
    pe[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return pe.float()


# Longest key sequence for which CPU bf16 attention takes the explicit path below (forward +
# backward against fp32 flash attention, bench/attention.py on a 2-core AMD EPYC with native
# bf16: 1.9x at 23 keys, 1.1-1.2x at 128, even at 160).
EXPLICIT_ATTENTION_KEYS = 128


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
           is_causal: bool, fast: bool = False,
           explicit_keys: int = EXPLICIT_ATTENTION_KEYS) -> Tensor:
    """``F.scaled_dot_product_attention``, or under CPU bf16 autocast fp32 scores and softmax.

    Without dropout, PyTorch's CPU kernel (flash attention) is about 2x slower in bf16 than
    in fp32 at d_head 64 (torch 2.13, AVX-512 CPU without AMX), and even in fp32 it spends
    more on its blocking than on the products when sequences are as short as the ones
    sentence-level batches hold (Multi30k: ~23 tokens). So under CPU bf16 autocast, up to
    ``explicit_keys`` keys (:data:`EXPLICIT_ATTENTION_KEYS`; -1: never), the scores and the
    softmax are computed in fp32 (as precise as the flash kernel's) and only the weighted
    sum of the values multiplies bf16 (the weights rounded to bf16, as autocast rounds any
    product's inputs, and as FlashAttention rounds them on GPUs): 1.9x faster than fp32
    flash attention at 23 keys, forward + backward, and the training step 1.09x with the
    loss change of the same commit (both on a 2-core AMD EPYC with native bf16;
    bench/README.md). Longer sequences take fp32 flash attention. Attention dropout
    (``dropout_p > 0``, in training) drops the fp32 weights before they are rounded, with
    :func:`aiayn.kernels.dropout`'s masks when ``fast`` and ``F.dropout``'s otherwise, as
    PyTorch's math path (which CPU attention with dropout takes) would; past the length
    limit, attention with dropout takes that math path. fp32 inputs and other devices take
    the plain call.
    """
    # (Shapes are read only on this path: compiled fp32 and GPU graphs get no guard on them.)
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16
            and (dropout_p == 0.0 or k.shape[-2] <= explicit_keys)):
        with torch.autocast("cpu", enabled=False):  # autocast would cast back to bf16
            if k.shape[-2] > explicit_keys:
                out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                     attn_mask=mask, is_causal=is_causal)
                return out.to(q.dtype)
            scores = torch.matmul(q.float(), k.float().transpose(-2, -1))
            scores.mul_(1.0 / math.sqrt(q.shape[-1]))
            # The lowest finite float, not -inf: a row with no key allowed (a batch's empty
            # sequence) then averages the values instead of turning NaN, as it would in
            # both directions through the softmax; flash attention skips such rows.
            low = torch.finfo(scores.dtype).min
            if is_causal:  # queries and keys line up (no cache): the upper triangle is out
                tq, tk = scores.shape[-2:]
                scores.masked_fill_(torch.ones(tq, tk, dtype=torch.bool,
                                               device=q.device).triu(1), low)
            if mask is not None:
                scores.masked_fill_(~mask, low)
            weights = scores.softmax(dim=-1)
            if dropout_p > 0.0:
                # Compiled, F.dropout becomes Inductor's own fused mask (as in Dropout).
                weights = (kernels.dropout(weights, dropout_p)
                           if fast and not torch.compiler.is_compiling()
                           else F.dropout(weights, dropout_p))
            return torch.matmul(weights.to(q.dtype), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal)


def avoid_cudnn_attention(device: torch.device) -> None:
    """On a CUDA device, take cuDNN's kernel out of ``F.scaled_dot_product_attention``'s
    choice, leaving flash, memory-efficient and math attention.

    Where PyTorch prefers it (Hopper GPUs, torch 2.11), cuDNN attention builds an execution
    plan for every new shape, about 20 ms of host time per call on an H200, and
    token-bucket batches and decoding bring new shapes all the time: without it the paper's
    base model stepped 7.2x faster on batches of new shapes, side by side (bench/README.md,
    "gpu_step.py"). The other kernels have no per-shape cost. A process-wide switch,
    so that compiled graphs see it too; nothing happens on other devices.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


class Linear(nn.Linear):
    """``nn.Linear``; with ``fast`` its forward product is ``aiayn.kernels.linear``."""

    def __init__(self, in_features: int, out_features: int, fast: bool = False):
        super().__init__(in_features, out_features)
        self.fast = fast

    def forward(self, x: Tensor) -> Tensor:
        if self.fast:
            return kernels.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Dropout(nn.Module):
    """Section 5.4's dropout; with ``fast`` on a CPU its masks come from
    ``aiayn.kernels.dropout``. On a GPU ``F.dropout`` is one fused kernel (mask and output
    together) where the int16 masks take five, so ``fast`` keeps it there;
    ``int16_on_cuda`` (bench.gpu_step --int16-dropout, the baseline) takes the int16 masks
    on a GPU too."""

    def __init__(self, p: float, fast: bool = False):
        super().__init__()
        self.p, self.fast = p, fast
        self.int16_on_cuda = False

    def forward(self, x: Tensor) -> Tensor:
        # Compiled, F.dropout becomes Inductor's own fused random mask.
        if (self.fast and not torch.compiler.is_compiling()
                and (x.device.type != "cuda" or self.int16_on_cuda)):
            return kernels.dropout(x, self.p, self.training)
        return F.dropout(x, self.p, self.training)


@dataclass
class Packing:
    """The real positions of a padded (B, T) batch, for layers that skip the padding.

    Position-wise layers (projections, feed-forward, LayerNorm, dropout) treat every
    position alike, so the decoder can run them on the N real positions alone, (N, d) rows
    in row-major order; attention alone needs the (B, T) layout and gets it from ``pad``
    (zeros at padding: with the causal mask, real queries never see those keys), except the
    CPU attention kernel, which reads and writes the packed rows where ``offsets`` places
    them (no padded copy either way: the multi30k step 1.06x on AMX, bench/README.md).
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


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h heads of scaled dot-product attention, queries and keys projected to
    d_k dimensions per head, values to d_v; the h * d_v concatenated outputs projected back
    to d_model. The paper's base has d_k = d_v = d_model / h.

    ``fast``: attention dropout masks from aiayn.kernels.dropout and the fast linear layers,
    and on CPU in fp32 or under bf16 autocast, up to ``kernels.ATTENTION_KERNEL_KEYS`` keys
    for that dtype, attention in one C++ pass straight from the projections' layout
    (:func:`aiayn.kernels.attention`); ``explicit_keys``: :func:`attend`'s limit of its CPU
    bf16 path (the kernel's too)."""

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float,
                 cross: bool, fast: bool = False,
                 explicit_keys: int = EXPLICIT_ATTENTION_KEYS):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.dropout, self.cross = heads, d_k, d_v, dropout, cross
        self.fast, self.explicit_keys = fast, explicit_keys
        hk, hv = heads * d_k, heads * d_v
        if cross:  # queries from the decoder, keys and values from the encoder output
            self.q_proj = Linear(d_model, hk, fast)
            self.kv_proj = Linear(d_model, hk + hv, fast)  # rows: keys, then values
        else:  # one fused projection: rows of queries, keys, then values
            self.qkv_proj = Linear(d_model, 2 * hk + hv, fast)
        self.out_proj = Linear(hv, d_model, fast)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, hd = x.shape
        return x.view(b, t, self.heads, hd // self.heads).transpose(1, 2)  # (B, H, T, d_k|d_v)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv_proj(memory).split([self.heads * self.d_k, self.heads * self.d_v], -1)
        return self.split_heads(k), self.split_heads(v)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, causal: bool = False,
                memory: Tensor | None = None, kv: tuple[Tensor, Tensor] | None = None,
                cache: dict | None = None, need_weights: bool = False,
                packing: Packing | None = None, group: int = 1
                ) -> tuple[Tensor, Tensor | None]:
        """x: (B, Tq, d), or (N, d) rows of ``packing``. mask: bool (B, 1, Tq|1, Tk), True
        where attention is allowed.

        Self-attention with ``cache`` appends this step's keys/values to cache["k"/"v"];
        cross-attention takes precomputed ``kv`` or projects ``memory``. With ``group`` g,
        cross-attention's keys, values and mask hold one row per g rows of ``x``
        (B = g * sources): each source's g rows attend as g * Tq queries of one row.
        """
        def padded(t: Tensor) -> Tensor:  # (B, Tq, k), also from packed rows
            return packing.pad(t) if packing is not None else t

        if self._takes_kernel(x, memory, mask, causal, kv, cache, need_weights, group,
                              packing):
            q, kv_all = ((self.q_proj(x), self.kv_proj(memory)) if self.cross
                         else (self.qkv_proj(x), None))
            # packed rows in and out where Packing.offsets places them: no padded copy
            offsets = None if packing is None else packing.offsets()
            packed = None if offsets is None else (offsets, packing.length)
            out = kernels.attention(q if packed else padded(q), kv_all, self.heads, self.d_k,
                                    self.d_v, mask, causal,
                                    self.dropout if self.training else 0.0, packed=packed)
            if packing is not None and packed is None:
                out = packing.unpad(out)
            return self.out_proj(out), None
        if self.cross:
            q = self.split_heads(padded(self.q_proj(x)))
            k, v = kv if kv is not None else self.project_kv(memory)
        else:
            hk, hv = self.heads * self.d_k, self.heads * self.d_v
            q, k, v = (self.split_heads(t)
                       for t in padded(self.qkv_proj(x)).split([hk, hk, hv], dim=-1))
            if cache is not None:
                if "k" in cache:
                    k = torch.cat([cache["k"], k], dim=2)  # (B, H, t_past + Tq, d_k)
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        b, _, tq, _ = q.shape
        if group > 1:
            if not self.cross or need_weights:
                raise ValueError("group applies to cross-attention without weights only")
            q = q.view(b // group, group, self.heads, tq, -1).transpose(1, 2).reshape(
                b // group, self.heads, group * tq, -1)
        drop = self.dropout if self.training else 0.0
        tk = k.shape[2]
        # A single query at the end of a cached prefix sees every key: no causal mask then.
        # Queries after a cached prefix (tk > tq) align to the bottom-right of the mask.
        if causal and tq > 1 and (need_weights or tk != tq):
            allowed = torch.ones(tq, tk, dtype=torch.bool, device=x.device).tril(tk - tq)
            mask = allowed if mask is None else mask & allowed
            causal = False
        if need_weights:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)  # (B, H, Tq, Tk)
            if mask is not None:  # the lowest float, as attend: no key allowed averages
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            weights = scores.softmax(dim=-1)
            out = F.dropout(weights, drop, self.training) @ v
        else:
            # Without a cache queries and keys line up (training; shapes may be symbolic
            # under torch.compile, so no test on them); a single query after a cached prefix
            # sees every key. The scale is 1/sqrt(d_k), q's last dimension.
            out = attend(q, k, v, mask, drop, causal if cache is None else causal and tk == tq,
                         self.fast, self.explicit_keys)
            weights = None
        if group > 1:  # (B / g, H, g * Tq, d_v) → (B, H, Tq, d_v)
            out = out.reshape(b // group, self.heads, group, tq, -1).transpose(1, 2).reshape(
                b, self.heads, tq, -1)
        out = out.transpose(1, 2).reshape(b, tq, -1)  # (B, Tq, H * d_v)
        if packing is not None:
            out = packing.unpad(out)
        return self.out_proj(out), weights

    def _takes_kernel(self, x: Tensor, memory: Tensor | None, mask: Tensor | None,
                      causal: bool, kv, cache, need_weights: bool, group: int,
                      packing: Packing | None) -> bool:
        """Whether the fast CPU step's attention kernel computes this call
        (:func:`aiayn.kernels.attention`: on CPU, in fp32 or under bf16 autocast, no cache,
        no weights asked for, at most ``explicit_keys`` keys as the explicit path of
        :func:`attend`, and at most ``kernels.ATTENTION_KERNEL_KEYS`` for the dtype)."""
        if not self.fast or kv is not None or cache is not None or need_weights or group != 1:
            return False
        dtype = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                 else x.dtype)
        if self.cross:
            keys = memory.shape[1]
        else:
            keys = packing.length if packing is not None else x.shape[1]
        return kernels.attention_applies(x.device, dtype, keys, self.explicit_keys, mask,
                                         causal)


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float, fast: bool = False):
        super().__init__()
        self.w1, self.w2 = Linear(d_model, d_ff, fast), Linear(d_ff, d_model, fast)
        self.activation_dropout = Dropout(activation_dropout, fast)

    def forward(self, x: Tensor) -> Tensor:
        if self.w1.fast and not (self.training and self.activation_dropout.p):
            # the same, with the ReLU fused into the product, and under CPU autocast the
            # hidden layer kept on padded rows between the two (aiayn.kernels, section 4)
            return kernels.feed_forward(x, self.w1.weight, self.w1.bias, self.w2.weight,
                                        self.w2.bias)
        if self.w1.fast:  # the same, with the ReLU fused into the product
            h = kernels.linear_relu(x, self.w1.weight, self.w1.bias)
        else:
            h = F.relu(self.w1(x))
        return self.w2(self.activation_dropout(h))


class Residual(nn.Module):
    """Section 3.1 / 5.4: LayerNorm(x + Dropout(Sublayer(x))) or its pre-LN variant."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool, fast: bool = False):
        super().__init__()
        self.norm, self.pre_norm, self.fast = nn.LayerNorm(d_model), pre_norm, fast
        self.dropout = Dropout(dropout, fast)

    def forward(self, x: Tensor, sublayer) -> tuple[Tensor, Tensor | None]:
        out, weights = sublayer(self.norm(x) if self.pre_norm else x)
        if (self.fast and not self.pre_norm and self.training
                and kernels.residual_norm_applies(x, out, self.norm.weight)):
            # Post-LN in training on a CPU: dropout, sum and LayerNorm in one C++ pass each
            # way (aiayn.kernels, section 5), the same math and keep rule.
            return kernels.residual_norm(x, out, self.norm.weight, self.norm.bias,
                                         self.dropout.p, self.norm.eps), weights
        x = x + self.dropout(out)
        return (x if self.pre_norm else self.norm(x)), weights


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, fast: bool = False,
                 explicit_keys: int = EXPLICIT_ATTENTION_KEYS):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.key_size, cfg.value_size,
                                            cfg.attention_dropout, False, fast, explicit_keys)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, fast)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, pre, fast)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, pre, fast)

    def forward(self, x: Tensor, src_mask: Tensor, need_weights: bool = False):
        x, w = self.res_attn(x, lambda h: self.self_attn(h, mask=src_mask,
                                                         need_weights=need_weights))
        x, _ = self.res_ffn(x, lambda h: (self.ffn(h), None))
        return x, w


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, fast: bool = False,
                 explicit_keys: int = EXPLICIT_ATTENTION_KEYS):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.key_size, cfg.value_size,
                                            cfg.attention_dropout, False, fast, explicit_keys)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.key_size,
                                             cfg.value_size, cfg.attention_dropout, True, fast,
                                             explicit_keys)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, fast)
        self.res_self = Residual(cfg.d_model, cfg.dropout, pre, fast)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, pre, fast)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, pre, fast)

    def forward(self, y: Tensor, memory: Tensor | None, src_mask: Tensor, *,
                cache: dict | None = None, need_weights: bool = False,
                packing: Packing | None = None, group: int = 1):
        y, w_self = self.res_self(y, lambda h: self.self_attn(
            h, causal=True, cache=cache, need_weights=need_weights, packing=packing))
        kv = cache.get("cross") if cache is not None else None
        if cache is not None and kv is None:
            kv = cache["cross"] = self.cross_attn.project_kv(memory)
        y, w_cross = self.res_cross(y, lambda h: self.cross_attn(
            h, mask=src_mask, memory=memory, kv=kv, need_weights=need_weights,
            packing=packing, group=group))
        y, _ = self.res_ffn(y, lambda h: (self.ffn(h), None))
        return y, w_self, w_cross


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
        bias = torch.full((vocab_size,), float("-inf"))
        bias[self.ids.cpu()] = 0.0
        return bias


@dataclass
class DecoderState:
    """What decoding carries between steps: encoder output, mask and per-layer caches."""

    memory: Tensor  # (N, S, d): one row per source
    src_mask: Tensor  # (N, 1, 1, S) bool
    caches: list[dict] = field(default_factory=list)
    position: int = 0
    # Decoder rows per source: rows g*r .. g*r + g - 1 read source r (beam search's g
    # hypotheses of one sentence). The source side (memory, mask, cross-attention keys and
    # values) is kept once per source, not copied per row and reordered with the beams.
    group: int = 1

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> DecoderState:
        """Select decoder rows ``index`` (beam search keeps the survivors): the
        self-attention caches. ``sources``: the sources kept, in order (the memory, the mask
        and the cross-attention caches); with ``group`` 1 they are the rows themselves, by
        default. With a larger group and no ``sources`` the sources stay as they are, and
        ``index`` must keep each row among its own source's rows."""
        if sources is None and self.group == 1:
            sources = index

        def pick(v: Tensor | tuple, i: Tensor | None) -> Tensor | tuple:
            if i is None:
                return v
            return tuple(t.index_select(0, i) for t in v) if isinstance(v, tuple) \
                else v.index_select(0, i)
        caches = [{k: pick(v, sources if k == "cross" else index) for k, v in c.items()}
                  for c in self.caches]
        return DecoderState(pick(self.memory, sources), pick(self.src_mask, sources), caches,
                            self.position, self.group)


class Transformer(nn.Module):
    """The model (see the module's docstring). ``fast`` chooses the fast training kernels for
    every layer; ``explicit_keys`` is :func:`attend`'s limit of its CPU bf16 path. Neither
    changes a parameter: the state dict is the same either way."""

    def __init__(self, cfg: TransformerConfig, fast: bool = False,
                 explicit_keys: int = EXPLICIT_ATTENTION_KEYS):
        super().__init__()
        self.cfg = cfg
        # Section 3.4: one matrix for source embedding, target embedding and output projection.
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.embed_dropout = Dropout(cfg.dropout, fast)
        # Section 3.5: a fixed sinusoid table (a buffer, not saved), or Table 3 row (E):
        # learned embeddings, one d_model row per position (parameters, saved as "positions").
        if cfg.positions == "learned":
            self.positions = nn.Parameter(torch.empty(cfg.max_positions, cfg.d_model))
        else:
            self.register_buffer("positions", sinusoidal_positions(cfg.max_positions,
                                                                   cfg.d_model),
                                 persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, fast, explicit_keys)
                                     for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg, fast, explicit_keys)
                                     for _ in range(cfg.decoder_layers))
        pre = cfg.norm == "pre"
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        # output_vocab "target": a logit bias, 0 for the tokens the softmax spans and -inf for
        # the others, saved with the weights (so decoding, averaging and export see it).
        self.register_buffer("output_bias", torch.zeros(cfg.vocab_size)
                             if cfg.output_vocab == "target" else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Embedding ~ N(0, d^-1/2), so that after the sqrt(d) scaling inputs have unit
        # variance; Xavier-uniform linear layers with zero biases (the paper does not say
        # how it initialised). Xavier takes each matrix's own shape and some projections are
        # fused, so with d_k = d_v = d / h self-attention's q, k and v (one (3d, d) matrix)
        # start at 1/sqrt(2) of a separate d x d matrix's scale (fairseq's gain for them),
        # cross-attention's k and v (one (2d, d)) at sqrt(2/3), and cross-attention's q, the
        # output and the feed-forward projections at Xavier's own (tensor2tensor's).
        nn.init.normal_(self.embedding.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embedding.weight[self.cfg.pad_id].zero_()
        if isinstance(self.positions, nn.Parameter):  # by default as fairseq's and t2t's
            nn.init.normal_(self.positions, mean=0.0,
                            std=self.cfg.position_init_std or self.cfg.d_model ** -0.5)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """Section 3.4-3.5: sqrt(d) * E[token] + PE[position] (sinusoid or learned), then
        dropout (5.4)."""
        t = tokens.shape[1]
        if offset + t > self.cfg.max_positions:
            raise ValueError(f"sequence of {offset + t} tokens exceeds model.max_positions "
                             f"({self.cfg.max_positions})")
        x = self.embedding(tokens) * math.sqrt(self.cfg.d_model)
        x = x + self.positions[offset:offset + t].to(x.dtype)
        return self.embed_dropout(x)

    def source_mask(self, src: Tensor) -> Tensor:
        return (src != self.cfg.pad_id)[:, None, None, :]  # (B, 1, 1, S): keys allowed

    def encode(self, src: Tensor, need_weights: bool = False):
        """src: (B, S) token ids → memory (B, S, d) [, per-layer self-attention weights]."""
        mask = self.source_mask(src)
        x, weights = self.embed(src), []
        for layer in self.encoder:
            x, w = layer(x, mask, need_weights)
            weights.append(w)
        x = self.encoder_norm(x)
        return (x, weights) if need_weights else x

    def logits(self, y: Tensor) -> Tensor:
        z = y @ self.embedding.weight.t()  # (B, T, V): the shared matrix, Section 3.4
        return z if self.output_bias is None else z + self.output_bias

    def set_output_vocab(self, ids: Tensor) -> None:
        """Let the softmax span only the tokens ``ids`` (output_vocab "target"): their
        logits are the shared matrix's products as before, every other logit is -inf. A
        vocabulary shared by two languages holds many tokens that never occur on the target
        side (the 8k BPE of Multi30k en->de spans 5,399); their rows still embed the
        source, but the projection, the largest product of a small model, skips them."""
        if self.output_bias is None:
            raise ValueError("set_output_vocab needs a model built with output_vocab='target'")
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.output_bias.device)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"output token ids must be a non-empty subset of 0.."
                             f"{self.cfg.vocab_size - 1}")
        self.output_bias.fill_(float("-inf"))
        self.output_bias[ids] = 0.0

    def output_vocab(self) -> OutputVocab | None:
        """The tokens the softmax spans (output_vocab "target", as the saved weights say);
        None: the whole vocabulary. The loss, decoding and export all ask here."""
        if self.output_bias is None:
            return None
        return OutputVocab.of((self.output_bias == 0).nonzero().squeeze(1), self.cfg.vocab_size,
                              self.cfg.pad_id)

    def forward(self, src: Tensor, tgt_in: Tensor, *, hidden: bool = False,
                packed: Tensor | None = None) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) → logits (B, T, V); with ``hidden``
        the decoder's output (B, T, d) that the logits project; with ``packed``, the flat
        positions of the real (non-pad) tokens of ``tgt_in`` (``Packing.positions``), that
        output at those positions only, (N, d) rows, computed without the padding."""
        memory = self.encode(src)
        mask = self.source_mask(src)
        packing = None if packed is None else Packing(packed, *tgt_in.shape)
        y = self.embed(tgt_in)
        if packing is not None:
            y = packing.unpad(y)
        for layer in self.decoder:
            y, _, _ = layer(y, memory, mask, packing=packing)
        y = self.decoder_norm(y)
        return y if hidden or packing is not None else self.logits(y)

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
        """Every attention distribution, per layer: each (B, heads, T_query, T_key)."""
        memory, enc = self.encode(src, need_weights=True)
        mask = self.source_mask(src)
        y, dec_self, cross = self.embed(tgt_in), [], []
        for layer in self.decoder:
            y, w_self, w_cross = layer(y, memory, mask, need_weights=True)
            dec_self.append(w_self)
            cross.append(w_cross)
        return {"encoder_self": enc, "decoder_self": dec_self, "cross": cross}

    # -- incremental decoding -------------------------------------------------------------

    def start(self, src: Tensor, group: int = 1) -> DecoderState:
        """Encode once; the returned state feeds ``decode_step``. ``group``: decoder rows per
        source (``decode_step`` then takes ``group`` rows of tokens for each source row)."""
        return DecoderState(self.encode(src), self.source_mask(src),
                            [{} for _ in self.decoder], 0, group)

    def decode_step(self, tokens: Tensor, state: DecoderState,
                    projection: Tensor | None = None) -> Tensor:
        """tokens: (B, t) new target tokens (usually t=1) → logits (B, t, V).

        Appends to the state's caches; the result equals the last t positions of a full
        forward pass over all tokens fed so far. With ``projection``, the rows of the
        shared matrix of some tokens (:meth:`OutputVocab.rows`), the logits of those
        tokens only, (B, t, len(rows)): the other tokens' products are never computed.
        """
        y = self.embed(tokens, offset=state.position)
        for layer, cache in zip(self.decoder, state.caches, strict=True):
            y, _, _ = layer(y, state.memory, state.src_mask, cache=cache, group=state.group)
        state.position += tokens.shape[1]
        y = self.decoder_norm(y)
        return self.logits(y) if projection is None else y @ projection.t()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
