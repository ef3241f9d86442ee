"""Batched beam search, as in the paper's Section 6.1.

"We used beam search with a beam size of 4 and length penalty alpha = 0.6 ... maximum output
length during inference to input length + 50, but terminate early when possible."

Conventions
-----------
* Length |Y| counts the generated tokens, EOS included, BOS excluded. A hypothesis cut at
  the maximum length L without EOS has |Y| = L. Hence an output has at most L - 1 tokens
  before its EOS, or exactly L tokens when it was cut.
* L = floor(max_len_a * source_length + max_len_b), where source_length counts the source's
  non-PAD tokens (its EOS included), capped at ``model.cfg.max_positions``.
* log P(Y|X) is the sum of fp32 ``log_softmax`` over the logits with PAD and BOS set to -inf
  (they can never be generated). A finished hypothesis ranks by
  log P(Y|X) / lp(Y) with GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016), the
  paper's; or, with ``length_norm="length"``, lp(Y) = |Y| ** alpha, the normalisation of
  CTranslate2 and Hugging Face transformers (both count EOS in |Y| too), so that the
  exported models (aiayn/export/convert.py) can be compared with ours hypothesis for hypothesis.
  The two agree at alpha = 0 and for |Y| = 1 (an empty output: EOS alone).

Algorithm (per sentence; all B sentences x ``beam`` hypotheses run as one batch of rows)
----------------------------------------------------------------------------------------
The beam holds ``k`` live hypotheses; at step 0 only the first is live (the others score
-inf), so the beam does not fill with copies of one prefix. Each step extends every live
hypothesis by every token, ranks the k * V candidates by log P, and takes the top 2k:

* an EOS candidate that ranks within the top k (it would take a beam slot) is finished and
  scored with the length penalty; only the best finished hypothesis is kept, since only it
  is returned (as fairseq: EOS outside the top k is not finalised);
* the top k non-EOS candidates (there are at least k among 2k) form the next live beam.

A sentence is done, and its rows leave the batch (``DecoderState.reorder``), when

(a) the top k candidates of a step are all finished (the beam holds no live hypothesis:
    with k = 1 this makes beam search exactly greedy decoding);
(b) no live hypothesis can beat the best finished one any more: log P only falls and is
    <= 0, so a live hypothesis with log P = s scores at most s / lp(L) however it ends
    (for alpha >= 0, where lp grows with |Y| under either normalisation; tensor2tensor's
    bound); ties keep the earlier hypothesis. Exact:
    decoding on to L would return the same output;
(c) it reaches L: the top k candidates of that step are finalised as they are, with |Y| = L.

The loop stops as soon as every sentence is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

NEG_INF = float("-inf")


@dataclass
class BeamConfig:
    beam: int = 4
    alpha: float = 0.6
    max_len_a: float = 1.0  # max output tokens = floor(a * source_length + b)
    max_len_b: int = 50
    length_norm: str = "gnmt"  # one of LENGTH_NORMS

    @classmethod
    def from_decode(cls, decode, *, max_len: int | None = None, **overrides) -> BeamConfig:
        """The settings of params' ``decode`` section (beam, alpha, max_len_a, max_len_b),
        each replaced by an override that is not None (say, a command-line option left
        unset is None). ``max_len``: a fixed cap on output tokens instead (a = 0, b =
        max_len). ``length_norm`` is not in the section: the override's, else GNMT's."""
        fields = {"beam": decode.beam, "alpha": decode.alpha,
                  "max_len_a": decode.max_len_a, "max_len_b": decode.max_len_b}
        unknown = set(overrides) - {*fields, "length_norm"}
        if unknown:
            raise TypeError(f"BeamConfig has no setting {', '.join(sorted(unknown))}")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        if max_len is not None:
            fields["max_len_a"], fields["max_len_b"] = 0.0, max_len
        return cls(**fields)


LENGTH_NORMS = ("gnmt", "length")


def length_penalty(length: int | Tensor, alpha: float, norm: str = "gnmt") -> float | Tensor:
    """lp(Y) for |Y| generated tokens including EOS: GNMT's ((5 + |Y|) / 6) ** alpha, or
    |Y| ** alpha for ``norm="length"`` (CTranslate2's and transformers' normalisation)."""
    if norm == "length":
        return length ** alpha
    return ((5 + length) / 6) ** alpha


def max_lengths(src: Tensor, a: float, b: int, limit: int) -> list[int]:
    """Per row: floor(a * (non-PAD source tokens) + b), within [0, limit]."""
    return [max(0, min(limit, math.floor(a * n + b)))
            for n in (src != PAD_ID).sum(1).tolist()]


@torch.no_grad()
def beam_search(model, src: Tensor, cfg: BeamConfig, *, use_cache: bool = True,
                spanned_only: bool = True) -> list[list[int]]:
    """src (B, S): padded source ids → per row the best hypothesis, without BOS and EOS.

    ``use_cache=False`` recomputes the whole prefix with ``model(src, prefix)`` each step
    (the slow reference). With a model whose softmax spans some tokens only
    (``model.output_vocab()``), the logits of those tokens alone are computed;
    ``spanned_only=False`` computes the whole vocabulary's, the others at -inf (the same
    outputs, more products). The model is put in eval mode for the call.
    """
    if src.dim() != 2:
        raise ValueError(f"src must be (batch, length), not {tuple(src.shape)}")
    if cfg.beam < 1:
        raise ValueError(f"beam must be at least 1, not {cfg.beam}")
    if cfg.length_norm not in LENGTH_NORMS:
        raise ValueError(f"length_norm must be one of {LENGTH_NORMS}, not {cfg.length_norm!r}")
    was_training = model.training
    model.eval()
    try:
        return _search(model, src, cfg, use_cache, spanned_only)
    finally:
        model.train(was_training)


def _search(model, src: Tensor, cfg: BeamConfig, use_cache: bool,
            spanned_only: bool) -> list[list[int]]:
    k, alpha, norm = cfg.beam, cfg.alpha, cfg.length_norm
    device = next(model.parameters()).device
    src = src.to(device)
    if not bool((src != PAD_ID).any(1).all()):
        raise ValueError("every source row needs at least one token (its EOS)")
    results: list[list[int]] = [[] for _ in range(src.shape[0])]
    lengths = max_lengths(src, cfg.max_len_a, cfg.max_len_b, model.cfg.max_positions)
    ids = [i for i, n in enumerate(lengths) if n > 0]  # original rows still decoding
    if not ids:
        return results
    src = src[ids]
    n = len(ids)
    max_len = torch.tensor([lengths[i] for i in ids], device=device)
    lp_max = length_penalty(max_len.double(), alpha, norm).float()
    banned = torch.tensor([PAD_ID, BOS_ID], device=device)
    # output_vocab "target": logits of the tokens the softmax spans only (the others' are
    # -inf: they add nothing to the softmax and are never chosen); `columns` maps back.
    columns = projection = None
    if spanned_only and (spanned := model.output_vocab()) is not None:
        columns, projection = spanned.ids, spanned.rows(model.embedding.weight)
        banned = torch.isin(columns, banned).nonzero()[:, 0]
    rows = torch.arange(n, device=device).repeat_interleave(k)
    if use_cache:
        state = model.start(src, group=k)  # the source side once per sentence
    else:
        src_rows = src[rows]
    tokens = torch.full((n * k, 1), BOS_ID, dtype=torch.long, device=device)  # BOS + prefix
    scores = torch.full((n, k), NEG_INF, device=device)  # log P of the live hypotheses
    scores[:, 0] = 0.0
    width = int(max_len.max())
    best_score = torch.full((n,), NEG_INF, device=device)  # best finished, normalised
    best_tokens = torch.zeros((n, width), dtype=torch.long, device=device)
    best_len = torch.zeros((n,), dtype=torch.long, device=device)

    for t in range(width):  # t tokens generated so far; this step makes token t + 1
        if use_cache:
            step = tokens[:, -1:]
            logits = (model.decode_step(step, state) if projection is None
                      else model.decode_step(step, state, projection))[:, -1]
        else:
            logits = model(src_rows, tokens)[:, -1]
            if columns is not None:
                logits = logits.index_select(1, columns)
        logits = logits.float().index_fill(1, banned, NEG_INF)  # never PAD or BOS
        vocab = logits.shape[-1]
        logp = F.log_softmax(logits, dim=-1)
        cand = (scores.view(-1, 1) + logp).view(n, k * vocab)
        vals, idx = cand.topk(min(2 * k, k * vocab), dim=1)  # sorted, best first
        beam, tok = idx // vocab, idx % vocab
        if columns is not None:
            tok = columns[tok]
        length = t + 1

        # Finalise: EOS within the top k, or every top-k candidate at the maximum length.
        last = max_len == length
        top_vals, top_tok = vals[:, :k], tok[:, :k]
        eos = top_tok == EOS_ID
        finite = torch.isfinite(top_vals)
        final = finite & (eos | last[:, None])
        normed = torch.where(final, top_vals / length_penalty(length, alpha, norm), NEG_INF)
        cand_score, pos = normed.max(dim=1)
        improved = cand_score > best_score
        src_row = torch.arange(n, device=device) * k + beam[:, :k].gather(1, pos[:, None])[:, 0]
        cand_tok = top_tok.gather(1, pos[:, None])[:, 0]
        best_score = torch.where(improved, cand_score, best_score)
        best_tokens[:, :t] = torch.where(improved[:, None], tokens[src_row, 1:],
                                         best_tokens[:, :t])
        best_tokens[:, t] = torch.where(improved, cand_tok, best_tokens[:, t])
        best_len = torch.where(improved, t + (cand_tok != EOS_ID).long(), best_len)

        # The next live beam: the top k non-EOS candidates.
        scores, pos = vals.masked_fill(tok == EOS_ID, NEG_INF).topk(k, dim=1)
        beam, tok = beam.gather(1, pos), tok.gather(1, pos)

        exhausted = ~(finite & ~eos).any(dim=1)  # (a)
        bound = scores[:, 0] / lp_max.clamp(min=length_penalty(length + 1, alpha, norm))  # (b)
        done = last | exhausted | (best_score >= bound)  # (c), (a), (b)
        done_list = done.tolist()
        if any(done_list):
            finished = done.nonzero()[:, 0]
            for i, seq, m in zip(finished.tolist(), best_tokens[finished].tolist(),
                                 best_len[finished].tolist(), strict=True):
                results[ids[i]] = seq[:m]
        keep = [i for i, d in enumerate(done_list) if not d]
        if not keep:
            return results

        # Keep the survivors' rows (and drop finished sentences) in one reorder.
        dropped = len(keep) < n
        ids = [ids[i] for i in keep]
        n = len(keep)
        keep_t = torch.tensor(keep, device=device)
        rows = (keep_t[:, None] * k + beam[keep_t]).view(-1)
        tokens = torch.cat([tokens[rows], tok[keep_t].view(-1, 1)], dim=1)
        scores, max_len, lp_max = scores[keep_t], max_len[keep_t], lp_max[keep_t]
        best_score, best_len = best_score[keep_t], best_len[keep_t]
        best_tokens = best_tokens[keep_t]
        if use_cache:
            # The source side follows the sentences only; greedy rows stay in place until
            # a sentence finishes (rows would be the identity).
            if dropped:
                state = state.reorder(rows, keep_t)
            elif k > 1:
                state = state.reorder(rows)
        else:
            src_rows = src_rows[rows]
    raise AssertionError("unreachable: every sentence is done at its maximum length")


@torch.no_grad()
def greedy_search(model, src: Tensor, max_len_a: float = 1.0, max_len_b: int = 50, *,
                  use_cache: bool = True, spanned_only: bool = True) -> list[list[int]]:
    """Greedy decoding: the most likely token at each step (beam search with beam 1)."""
    cfg = BeamConfig(beam=1, alpha=0.0, max_len_a=max_len_a, max_len_b=max_len_b)
    return beam_search(model, src, cfg, use_cache=use_cache, spanned_only=spanned_only)
