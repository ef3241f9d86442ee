"""Beam search against exhaustive search, greedy decoding, recomputation and its own limits.

Conventions under test (see aiayn/decoding/beam.py): |Y| counts generated tokens with EOS; a
hypothesis cut at the maximum length L has |Y| = L; log P excludes PAD and BOS (renormalised).
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from aiayn.decoding.beam import BeamConfig, beam_search, greedy_search, length_penalty
from aiayn.model import DecoderState, Transformer, TransformerConfig

PAD, BOS, EOS = 0, 1, 2
FIRST_CONTENT = 3


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: intra-op threads only add overhead (and fight a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(seed: int = 0, vocab: int = 10, scale: float = 1.0) -> Transformer:
    """A random model whose next-token distribution depends on the context.

    With the shared output matrix a random Transformer mostly repeats one token; an untied
    random output projection (and pre-LN, larger embeddings) gives varied hypotheses.
    """
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, d_model=16, heads=2, encoder_layers=1,
                            decoder_layers=2, d_ff=32, dropout=0.0, norm="pre",
                            max_positions=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.embedding.weight.normal_(0.0, 1.0)
    out = torch.randn(vocab, cfg.d_model) * scale
    model.logits = lambda y: y @ out.t().to(y.dtype)
    return model


def bias_logits(model: Transformer, token: int, value: float) -> Transformer:
    inner = model.logits

    def logits(y):
        z = inner(y)
        return torch.cat([z[..., :token], z[..., token:token + 1] + value, z[..., token + 1:]], -1)

    model.logits = logits
    return model


class Bigram(torch.nn.Module):
    """A hand-made model: the next token's distribution depends on the previous token only.

    ``probs[prev][token]`` = P(token | prev); unlisted tokens get logit -30 (about 1e-13).
    """

    def __init__(self, probs: dict[int, dict[int, float]], vocab: int = 5):
        super().__init__()
        table = torch.full((vocab, vocab), -30.0)
        for prev, row in probs.items():
            for token, p in row.items():
                table[prev, token] = math.log(p)
        self.table = torch.nn.Parameter(table, requires_grad=False)
        self.cfg = SimpleNamespace(max_positions=64)

    def forward(self, src, tgt_in):
        return self.table[tgt_in]

    def start(self, src, group=1):
        return DecoderState(src[:, :, None].float(), src != PAD, [{}], 0, group)

    def decode_step(self, tokens, state):
        state.position += tokens.shape[1]
        return self.table[tokens]

    def output_vocab(self):
        return None  # its softmax spans every token, as a Transformer's by default


def count_decode_steps(model: Transformer) -> list[int]:
    """Record the number of rows of every ``decode_step`` call."""
    rows, step = [], model.decode_step

    def decode_step(tokens, state):
        rows.append(tokens.shape[0])
        return step(tokens, state)

    model.decode_step = decode_step
    return rows


def ragged(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sources of ``lengths`` tokens each (content + EOS), and their right-padded batch."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.randint(FIRST_CONTENT, vocab, (n - 1,), generator=g),
                       torch.tensor([EOS])]) for n in lengths]
    batch = torch.full((len(rows), max(lengths)), PAD)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return batch, rows


@torch.no_grad()
def logprobs(model: Transformer, src: torch.Tensor, tgt_in: list[list[int]]) -> torch.Tensor:
    """Full recompute: log P(next | prefix) over the vocabulary without PAD and BOS.

    ``tgt_in`` rows are right-padded with PAD; by causality padding never changes the
    positions before it.
    """
    width = max(map(len, tgt_in))
    tgt = torch.tensor([row + [PAD] * (width - len(row)) for row in tgt_in])
    logits = model(src[None].expand(len(tgt_in), -1), tgt).float()
    logits[..., [PAD, BOS]] = float("-inf")
    return F.log_softmax(logits, dim=-1)


def reference_greedy(model: Transformer, src: torch.Tensor, max_len: int) -> list[int]:
    prefix = [BOS]
    for _ in range(max_len):
        token = int(logprobs(model, src, [prefix])[0, -1].argmax())
        if token == EOS:
            break
        prefix.append(token)
    return prefix[1:]


def exhaustive_scores(model, src, max_len: int, alpha: float, norm: str = "gnmt"
                      ) -> dict[tuple[int, ...], float]:
    """log P(Y|X) / ((5 + |Y|) / 6) ** alpha (GNMT) or / |Y| ** alpha (norm "length") for
    every possible output Y.

    Finished: 0 .. max_len - 1 content tokens then EOS; cut: max_len content tokens.
    """
    content = range(FIRST_CONTENT, int(model.cfg.vocab_size))
    outputs = [(seq, True) for n in range(max_len) for seq in itertools.product(content, repeat=n)]
    outputs += [(seq, False) for seq in itertools.product(content, repeat=max_len)]
    targets = [list(seq) + ([EOS] if finished else []) for seq, finished in outputs]
    lp = logprobs(model, src, [[BOS] + target[:-1] for target in targets])
    scores = {}
    for row, ((seq, _), target) in enumerate(zip(outputs, targets, strict=True)):
        total = sum(float(lp[row, i, tok]) for i, tok in enumerate(target))
        n = len(target)
        scores[seq] = total / (n ** alpha if norm == "length" else ((5 + n) / 6) ** alpha)
    return scores


def test_length_penalty_follows_the_gnmt_formula():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx(2 ** 0.6)
    assert length_penalty(19, 1.0) == pytest.approx(4.0)
    assert length_penalty(30, 0.0) == pytest.approx(1.0)
    got = length_penalty(torch.tensor([1.0, 7.0, 25.0]), 1.0)
    assert torch.allclose(got, torch.tensor([1.0, 2.0, 5.0]))
    assert length_penalty(4, 0.6) < length_penalty(5, 0.6)


def test_length_penalty_can_follow_ctranslate2_and_transformers():
    # |Y| ** alpha: what CTranslate2 and transformers divide by; equal to GNMT at |Y| = 1.
    assert length_penalty(1, 0.6, "length") == pytest.approx(1.0)
    assert length_penalty(8, 1.0, "length") == pytest.approx(8.0)
    assert length_penalty(9, 0.5, "length") == pytest.approx(3.0)
    assert length_penalty(30, 0.0, "length") == pytest.approx(1.0)
    got = length_penalty(torch.tensor([1.0, 4.0, 16.0]), 0.5, "length")
    assert torch.allclose(got, torch.tensor([1.0, 2.0, 4.0]))
    with pytest.raises(ValueError, match="length_norm"):
        beam_search(tiny(0), torch.tensor([[5, EOS]]), BeamConfig(length_norm="words"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_is_greedy_decoding(seed):
    model = tiny(seed)
    batch, rows = ragged([2, 5, 3, 7, 4], vocab=10, seed=seed)
    a, b = 1.0, 3
    expected = [reference_greedy(model, row, math.floor(a * len(row) + b)) for row in rows]
    limits = [math.floor(a * len(row) + b) for row in rows]
    rows_decoded = count_decode_steps(model)
    cfg = BeamConfig(beam=1, alpha=0.6, max_len_a=a, max_len_b=b)
    assert beam_search(model, batch, cfg) == expected
    # Each sentence stops at its first EOS: it takes part in len(output) + 1 steps, or L.
    assert sum(rows_decoded) == sum(min(len(out) + 1, limit)
                                    for out, limit in zip(expected, limits, strict=True))
    assert greedy_search(model, batch, a, b) == expected
    assert greedy_search(model, batch, a, b, use_cache=False) == expected


EXHAUSTIVE_SEEDS = [0, 1, 3, 4]
ALPHAS = [0.0, 0.6, 1.0]


@pytest.mark.parametrize("norm", ["gnmt", "length"])
@pytest.mark.parametrize("max_len", [4, 5])
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("seed", EXHAUSTIVE_SEEDS)
def test_wide_beam_finds_the_exhaustive_best(seed, alpha, max_len, norm):
    vocab = 5  # PAD, BOS, EOS and two content tokens (3, 4)
    model = tiny(seed, vocab, scale=0.3)
    src = ragged([3], vocab, seed)[1][0]
    scores = exhaustive_scores(model, src, max_len, alpha, norm)
    assert len(scores) == 2 ** (max_len + 1) - 1
    # A beam as wide as the number of outputs prunes nothing, so beam search is exact.
    cfg = BeamConfig(beam=len(scores), alpha=alpha, max_len_a=0.0, max_len_b=max_len,
                     length_norm=norm)
    for use_cache in (True, False):
        (found,) = beam_search(model, src[None], cfg, use_cache=use_cache)
        assert scores[tuple(found)] == pytest.approx(max(scores.values()), abs=1e-5)
        assert found == list(max(scores, key=scores.get))


def test_the_exhaustive_cases_are_not_vacuous():
    """Their winners include an empty output, a middling one and one cut at max_len, and
    for some source the winner depends on alpha."""
    kinds, alpha_matters, norm_matters = set(), False, False
    for seed, max_len in itertools.product(EXHAUSTIVE_SEEDS, [4, 5]):
        src = ragged([3], 5, seed)[1][0]
        winners = set()
        for alpha in ALPHAS:
            best = {}
            for norm in ("gnmt", "length"):
                scores = exhaustive_scores(tiny(seed, 5, scale=0.3), src, max_len, alpha, norm)
                best[norm] = max(scores, key=scores.get)
            winners |= set(best.values())
            norm_matters |= best["gnmt"] != best["length"]
        kinds |= {"empty" if not w else "cut" if len(w) == max_len else "middle"
                  for w in winners}
        alpha_matters |= len(winners) > 1
    assert kinds == {"empty", "middle", "cut"}
    assert alpha_matters
    assert norm_matters  # the two normalisations pick different outputs somewhere


# After BOS: EOS 0.6, A 0.39, B 0.01; after A: A 0.998, EOS 0.001, B 0.001; after B: EOS.
A, B = 3, 4
CHAIN = {BOS: {EOS: 0.6, A: 0.39, B: 0.01}, A: {A: 0.998, EOS: 0.001, B: 0.001}, B: {EOS: 1.0},
         EOS: {EOS: 1.0}}


@pytest.mark.parametrize(("alpha", "expected"), [(0.0, []), (0.6, []), (1.0, [A] * 8)])
@pytest.mark.parametrize("use_cache", [True, False])
def test_length_penalty_can_prefer_a_long_cut_hypothesis(alpha, expected, use_cache):
    """[] scores log 0.6 = -0.51 whatever alpha; A^8, cut at L = 8, scores
    (log 0.39 + 7 log 0.998) / lp(8) = -0.96 / lp(8): -0.96, -0.60 and -0.44 for alpha
    0, 0.6 and 1. After step 1 the live A (log P = -0.94) trails [] in every ranking that
    ignores the length still to come, so a too-hasty stopping rule returns []."""
    src = torch.tensor([[A, EOS]])
    cfg = BeamConfig(beam=4, alpha=alpha, max_len_a=0.0, max_len_b=8)
    assert beam_search(Bigram(CHAIN), src, cfg, use_cache=use_cache) == [expected]
    empty = math.log(0.6)
    cut = (math.log(0.39) + 7 * math.log(0.998)) / length_penalty(8, alpha)
    assert (cut > empty) == bool(expected)


def test_greedy_stops_at_the_first_likely_eos():
    model = Bigram(CHAIN)
    steps = count_decode_steps(model)
    src = torch.tensor([[A, EOS], [B, EOS]])
    assert beam_search(model, src, BeamConfig(beam=1, alpha=1.0, max_len_a=0.0,
                                              max_len_b=8)) == [[], []]
    assert steps == [2]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("beam", "alpha"), [(4, 0.6), (2, 1.0), (5, 0.0)])
def test_cached_decoding_equals_recompute(seed, beam, alpha):
    model = tiny(seed)
    batch, _ = ragged([4, 2, 6, 3, 5], vocab=10, seed=seed + 10)
    cfg = BeamConfig(beam=beam, alpha=alpha, max_len_a=1.0, max_len_b=4)
    cached = beam_search(model, batch, cfg)
    assert cached == beam_search(model, batch, cfg, use_cache=False)
    for out, row in zip(cached, batch, strict=True):
        assert len(out) <= int((row != PAD).sum()) + 4
        assert all(FIRST_CONTENT <= tok < 10 for tok in out)


@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_batched_decoding_equals_one_sentence_at_a_time(seed):
    model = tiny(seed)
    batch, rows = ragged([3, 7, 2, 5, 4, 6], vocab=10, seed=seed + 20)
    cfg = BeamConfig(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=3)
    together = beam_search(model, batch, cfg)
    alone = [beam_search(model, row[None], cfg)[0] for row in rows]
    assert together == alone
    assert len({len(out) for out in together}) > 1  # hypotheses of several lengths
    assert together != greedy_search(model, batch, 1.0, 3)  # the beam does search


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize(("a", "b"), [(1.0, 2), (0.5, 1), (1.5, 0)])
def test_maximum_length_is_respected_and_finished_sentences_leave_the_batch(beam, a, b):
    model = bias_logits(tiny(0), EOS, float("-inf"))  # never ends on its own
    batch, rows = ragged([1, 4, 2, 6], vocab=10, seed=3)
    limits = [math.floor(a * len(row) + b) for row in rows]
    sizes = count_decode_steps(model)
    out = beam_search(model, batch, BeamConfig(beam=beam, max_len_a=a, max_len_b=b))
    assert [len(seq) for seq in out] == limits
    assert all(FIRST_CONTENT <= tok < 10 for seq in out for tok in seq)
    # Step t decodes beam rows for each sentence whose maximum length exceeds t.
    assert sizes == [beam * sum(limit > t for limit in limits) for t in range(max(limits))]


def test_zero_maximum_length_gives_empty_outputs():
    batch, _ = ragged([2, 3], vocab=10, seed=0)
    out = beam_search(tiny(0), batch, BeamConfig(max_len_a=0.0, max_len_b=0))
    assert out == [[], []]


def test_stops_as_soon_as_nothing_can_beat_the_finished_hypothesis():
    model = bias_logits(tiny(1), EOS, 20.0)  # EOS first is nearly certain
    steps = count_decode_steps(model)
    batch, _ = ragged([3, 5], vocab=10, seed=1)
    assert beam_search(model, batch, BeamConfig(beam=4, max_len_b=50)) == [[], []]
    assert len(steps) == 1


def test_pad_and_bos_are_never_generated():
    model = bias_logits(bias_logits(tiny(2), PAD, 30.0), BOS, 30.0)
    batch, _ = ragged([3, 5, 2], vocab=10, seed=4)
    for cfg in (BeamConfig(beam=1, max_len_b=3), BeamConfig(beam=4, max_len_b=3)):
        for out in beam_search(model, batch, cfg):
            assert all(tok not in (PAD, BOS, EOS) for tok in out)


def test_runs_under_bf16_autocast_and_restores_training_mode():
    model = tiny(0).train()
    batch, rows = ragged([3, 6, 2], vocab=10, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = beam_search(model, batch, BeamConfig(beam=4, max_len_a=1.0, max_len_b=3))
    assert model.training
    for seq, row in zip(out, rows, strict=True):
        assert len(seq) <= len(row) + 3
        assert all(FIRST_CONTENT <= tok < 10 for tok in seq)


def test_rejects_empty_sources_and_empty_beams():
    with pytest.raises(ValueError, match="at least one token"):
        beam_search(tiny(0), torch.tensor([[5, EOS], [PAD, PAD]]), BeamConfig())
    with pytest.raises(ValueError, match="beam"):
        beam_search(tiny(0), torch.tensor([[5, EOS]]), BeamConfig(beam=0))


def test_from_decode_takes_the_decode_section_and_the_overrides_that_are_set():
    from aiayn.config import DecodeConfig

    d = DecodeConfig(beam=5, alpha=0.8, max_len_a=1.5, max_len_b=7, batch_size=3)
    assert BeamConfig.from_decode(d) == BeamConfig(beam=5, alpha=0.8, max_len_a=1.5,
                                                   max_len_b=7, length_norm="gnmt")
    # None: not set (the section's value); 0 and 0.0 are values, not "unset"
    assert BeamConfig.from_decode(d, beam=None, alpha=0.0, max_len_a=None, max_len_b=0,
                                  length_norm="length") == BeamConfig(
        beam=5, alpha=0.0, max_len_a=1.5, max_len_b=0, length_norm="length")
    # a fixed cap replaces a * source + b, whatever a and b say
    assert BeamConfig.from_decode(d, beam=1, max_len_a=3.0, max_len=9) == BeamConfig(
        beam=1, alpha=0.8, max_len_a=0.0, max_len_b=9)
    assert BeamConfig.from_decode(DecodeConfig()) == BeamConfig()  # the paper's, both ways
    with pytest.raises(TypeError, match="no setting batch_size"):
        BeamConfig.from_decode(d, batch_size=4)
