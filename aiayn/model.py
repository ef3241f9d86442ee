"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), Section 3.

Readable top to bottom against the paper:

* 3.1  encoder and decoder stacks of N identical layers; each sub-layer is wrapped as
       LayerNorm(x + Dropout(Sublayer(x)))  (post-LN, the paper) or, as an option,
       x + Dropout(Sublayer(LayerNorm(x)))  (pre-LN, with a final LayerNorm per stack);
* 3.2  multi-head scaled dot-product attention (h heads, queries and keys of d_k, values of
       d_v dimensions; d_k = d_v = d_model / h unless set apart, as Table 3 rows (A), (B)),
       through torch's fused kernels (:func:`aiayn.sdpa.attend`), with an explicit path that
       also returns the attention weights for plots;
* 3.3  position-wise feed-forward network  max(0, xW1 + b1)W2 + b2;
* 3.4  one weight matrix shared by the source embedding, the target embedding and the
       pre-softmax projection; embeddings multiplied by sqrt(d_model); as an option
       (``output_vocab="target"``) the projection keeps only the rows of the tokens that
       occur on the target side (:meth:`Transformer.set_output_vocab`);
* 3.5  sinusoidal positional encodings, or (``positions="learned"``, Table 3 row (E))
       learned positional embeddings as in ConvS2S [9];
* 5.4  dropout on every sub-layer output and on the sums of embeddings and positions.

The model knows nothing of files or tokenizers. Decoding uses ``encode`` once per source
and ``decode_step`` per target token with a key/value cache (:mod:`aiayn.decoder_state`).
The fast training kernels are not here: :func:`aiayn.fast.apply` swaps a built model's
layers for variants that compute the same with fewer passes over memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.decoder_state import DecoderState
from aiayn.output_vocab import OutputVocab
from aiayn.sdpa import attend


@dataclass
class TransformerConfig:
    vocab_size: int
    d_model: int = 512
    heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # residual and embedding dropout, Section 5.4
    attention_dropout: float = 0.0  # these two are not in the paper (tensor2tensor's)
    activation_dropout: float = 0.0
    norm: str = "post"  # "post" as the paper, or "pre"
    max_positions: int = 1024  # rows of the position table (learned: parameters)
    # Section 3.2.2: per head, queries and keys of d_k and values of d_v dimensions (Table 3
    # (A), (B)); 0: d_model / heads, kept as 0 so that older models' run identity holds.
    d_k: int = 0
    d_v: int = 0
    positions: str = "sinusoidal"  # Section 3.5, or "learned" (Table 3 row (E))
    # Learned positions start ~ N(0, position_init_std); 0: d_model^-1/2 (fairseq's, t2t's).
    position_init_std: float = 0.0
    pad_id: int = 0
    output_vocab: str = "shared"  # Section 3.4, or "target" (aiayn.output_vocab)

    def __post_init__(self) -> None:
        if self.d_k < 0 or self.d_v < 0:
            raise ValueError(f"d_k ({self.d_k}) and d_v ({self.d_v}) must be positive, or 0 "
                             "for d_model / heads")
        if (not self.d_k or not self.d_v) and self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads}) "
                             "where d_k or d_v is left at d_model / heads")
        for name, allowed in (("positions", ("sinusoidal", "learned")),
                              ("norm", ("post", "pre")), ("output_vocab", ("shared", "target"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be {' or '.join(map(repr, allowed))}, not "
                                 f"{getattr(self, name)!r}")
        if self.position_init_std < 0:
            raise ValueError(f"position_init_std ({self.position_init_std}) must be positive, "
                             "or 0 for d_model^-1/2")

    @property
    def key_size(self) -> int:  # d_k, of one head's queries and keys
        return self.d_k or self.d_model // self.heads

    @property
    def value_size(self) -> int:  # d_v, of one head's values
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


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h heads of scaled dot-product attention, queries and keys projected to
    d_k dimensions per head, values to d_v; the h * d_v concatenated outputs to d_model."""

    weights_dropout = staticmethod(F.dropout)  # of the weights, on attend's explicit path

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float,
                 cross: bool):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.dropout, self.cross = heads, d_k, d_v, dropout, cross
        hk, hv = heads * d_k, heads * d_v
        if cross:  # queries from the decoder, keys and values from the encoder output
            self.q_proj = nn.Linear(d_model, hk)
            self.kv_proj = nn.Linear(d_model, hk + hv)  # rows: keys, then values
        else:  # one fused projection: rows of queries, keys, then values
            self.qkv_proj = nn.Linear(d_model, 2 * hk + hv)
        self.out_proj = nn.Linear(hv, d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, hd = x.shape
        return x.view(b, t, self.heads, hd // self.heads).transpose(1, 2)  # (B, H, T, d_k|d_v)

    def project(self, x: Tensor) -> Tensor:
        """x's queries (cross-attention), or its queries, keys and values, side by side."""
        return self.q_proj(x) if self.cross else self.qkv_proj(x)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.kv_proj(memory).split([self.heads * self.d_k, self.heads * self.d_v], -1)
        return self.split_heads(k), self.split_heads(v)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, causal: bool = False,
                memory: Tensor | None = None, kv: tuple[Tensor, Tensor] | None = None,
                cache: dict | None = None, need_weights: bool = False, group: int = 1
                ) -> tuple[Tensor, Tensor | None]:
        """x: (B, Tq, d). mask: bool (B, 1, Tq|1, Tk), True where attention is allowed.
        Self-attention with ``cache`` appends this step's keys/values to cache["k"/"v"];
        cross-attention takes precomputed ``kv`` or projects ``memory``. With ``group`` g,
        cross-attention's keys, values and mask hold one row per g rows of ``x`` (B = g *
        sources): each source's g rows attend as g * Tq queries of one row."""
        out, weights = self.attend_heads(self.project(x), mask, causal, memory, kv, cache,
                                         need_weights, group)
        return self.out_proj(out), weights

    def attend_heads(self, projected: Tensor, mask: Tensor | None, causal: bool,
                     memory: Tensor | None, kv: tuple[Tensor, Tensor] | None,
                     cache: dict | None, need_weights: bool, group: int
                     ) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward` between the projections: the heads of ``projected`` attend, their
        outputs concatenated, (B, Tq, h * d_v) [, the weights]."""
        if self.cross:
            q = self.split_heads(projected)
            k, v = kv if kv is not None else self.project_kv(memory)
        else:
            hk, hv = self.heads * self.d_k, self.heads * self.d_v
            q, k, v = (self.split_heads(t) for t in projected.split([hk, hk, hv], dim=-1))
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
            allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
            mask = allowed if mask is None else mask & allowed
            causal = False
        if need_weights:  # Section 3.2.1 written out: softmax(q k^T / sqrt(d_k)) v
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)  # (B, H, Tq, Tk)
            if mask is not None:  # the lowest float, as attend: no key allowed averages
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            weights = scores.softmax(dim=-1)
            out = F.dropout(weights, drop, self.training) @ v
        else:
            # Without a cache queries and keys line up (no test on shapes, which may be
            # symbolic under torch.compile); scaled by 1/sqrt(d_k), q's last dimension.
            out = attend(q, k, v, mask, drop, causal if cache is None else causal and tk == tq,
                         dropout=self.weights_dropout)
            weights = None
        if group > 1:  # (B / g, H, g * Tq, d_v) → (B, H, Tq, d_v)
            out = out.reshape(b // group, self.heads, group, tq, -1).transpose(1, 2).reshape(
                b, self.heads, tq, -1)
        return out.transpose(1, 2).reshape(b, tq, -1), weights  # (B, Tq, H * d_v)


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activation_dropout(F.relu(self.w1(x))))


class Residual(nn.Module):
    """Section 3.1 / 5.4: LayerNorm(x + Dropout(Sublayer(x))) or its pre-LN variant."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm, self.pre_norm = nn.LayerNorm(d_model), pre_norm
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, sublayer) -> tuple[Tensor, Tensor | None]:
        out, weights = sublayer(self.norm(x) if self.pre_norm else x)
        return self.add(x, out), weights

    def add(self, x: Tensor, out: Tensor) -> Tensor:
        """x + Dropout(out), then LayerNorm (post-LN)."""
        x = x + self.dropout(out)
        return x if self.pre_norm else self.norm(x)


def attention(cfg: TransformerConfig, cross: bool) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.heads, cfg.key_size, cfg.value_size,
                              cfg.attention_dropout, cross)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = attention(cfg, cross=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.res_attn, self.res_ffn = (Residual(cfg.d_model, cfg.dropout, cfg.norm == "pre")
                                       for _ in range(2))

    def forward(self, x: Tensor, src_mask: Tensor, need_weights: bool = False):
        x, w = self.res_attn(x, lambda h: self.self_attn(h, mask=src_mask,
                                                         need_weights=need_weights))
        x, _ = self.res_ffn(x, lambda h: (self.ffn(h), None))
        return x, w


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn, self.cross_attn = attention(cfg, cross=False), attention(cfg, cross=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout)
        self.res_self, self.res_cross, self.res_ffn = (
            Residual(cfg.d_model, cfg.dropout, cfg.norm == "pre") for _ in range(3))

    def forward(self, y: Tensor, memory: Tensor | None, src_mask: Tensor, *,
                cache: dict | None = None, need_weights: bool = False, group: int = 1):
        y, w_self = self.res_self(y, lambda h: self.self_attn(
            h, causal=True, cache=cache, need_weights=need_weights))
        kv = cache.get("cross") if cache is not None else None
        if cache is not None and kv is None:
            kv = cache["cross"] = self.cross_attn.project_kv(memory)
        y, w_cross = self.res_cross(y, lambda h: self.cross_attn(
            h, mask=src_mask, memory=memory, kv=kv, need_weights=need_weights, group=group))
        y, _ = self.res_ffn(y, lambda h: (self.ffn(h), None))
        return y, w_self, w_cross


class Transformer(nn.Module):
    """The model (see the module's docstring)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        # Section 3.4: one matrix for source embedding, target embedding and output projection.
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        # Section 3.5's sinusoids (a buffer, not saved), or Table 3 (E): learned, saved.
        if cfg.positions == "learned":
            self.positions = nn.Parameter(torch.empty(cfg.max_positions, cfg.d_model))
        else:
            table = sinusoidal_positions(cfg.max_positions, cfg.d_model)
            self.register_buffer("positions", table, persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.encoder_norm, self.decoder_norm = (
            nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity() for _ in range(2))
        # output_vocab "target": a logit bias (0 spanned, -inf not), saved with the weights.
        self.register_buffer("output_bias", torch.zeros(cfg.vocab_size)
                             if cfg.output_vocab == "target" else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Embedding ~ N(0, d^-1/2): unit variance after the sqrt(d) scaling; Xavier-uniform
        # linear layers, zero biases (the paper does not say). Xavier takes each matrix's
        # shape: with d_k = d_v = d / h self-attention's fused q, k, v start at 1/sqrt(2) of a
        # d x d matrix's scale (fairseq's gain), cross-attention's k, v at sqrt(2/3).
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
        """Section 3.4-3.5: sqrt(d) * E[token] + PE[position], then dropout (5.4)."""
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
        """Let the softmax span only the tokens ``ids`` (output_vocab "target",
        :mod:`aiayn.output_vocab`): every other logit is -inf."""
        if self.output_bias is None:
            raise ValueError("set_output_vocab needs a model built with output_vocab='target'")
        self.output_bias.copy_(OutputVocab.bias_of(ids, self.cfg.vocab_size))

    def output_vocab(self) -> OutputVocab | None:
        """The tokens the softmax spans, as the saved weights say (None: all of them)."""
        if self.output_bias is None:
            return None
        return OutputVocab.of((self.output_bias == 0).nonzero().squeeze(1), self.cfg.vocab_size,
                              self.cfg.pad_id)

    def forward(self, src: Tensor, tgt_in: Tensor, *, hidden: bool = False) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) → logits (B, T, V); with ``hidden``
        the decoder's output (B, T, d) that the logits project."""
        memory = self.encode(src)
        mask = self.source_mask(src)
        y = self.embed(tgt_in)
        for layer in self.decoder:
            y, _, _ = layer(y, memory, mask)
        y = self.decoder_norm(y)
        return y if hidden else self.logits(y)

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

    def start(self, src: Tensor, group: int = 1) -> DecoderState:
        """Encode once; the returned state feeds ``decode_step``. ``group``: decoder rows per
        source (``decode_step`` then takes ``group`` rows of tokens for each source row)."""
        return DecoderState(self.encode(src), self.source_mask(src),
                            [{} for _ in self.decoder], 0, group)

    def decode_step(self, tokens: Tensor, state: DecoderState,
                    projection: Tensor | None = None) -> Tensor:
        """tokens: (B, t) new target tokens (usually t=1) → logits (B, t, V), the last t
        positions of a full forward pass over all tokens fed so far (the state's caches
        grow). With ``projection`` (:meth:`OutputVocab.rows`), those tokens' logits only."""
        y = self.embed(tokens, offset=state.position)
        for layer, cache in zip(self.decoder, state.caches, strict=True):
            y, _, _ = layer(y, state.memory, state.src_mask, cache=cache, group=state.group)
        state.position += tokens.shape[1]
        y = self.decoder_norm(y)
        return self.logits(y) if projection is None else y @ projection.t()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
