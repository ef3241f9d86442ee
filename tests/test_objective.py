"""Schedule and loss against the paper's formulas and a brute-force computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.training.objective import label_smoothed_loss, make_optimizer, rdrop_loss
from aiayn.training.schedule import cooldown_factor, noam_lr


@pytest.mark.parametrize("step", [1, 10, 3999, 4000, 4001, 100_000])
def test_noam_schedule_is_equation_3(step):
    d, w = 512, 4000
    assert noam_lr(step, d, w) == pytest.approx(d ** -0.5 * min(step ** -0.5, step * w ** -1.5))
    assert noam_lr(step, d, w, scale=2.0) == pytest.approx(2 * noam_lr(step, d, w))


def test_schedule_peaks_at_warmup():
    rates = [noam_lr(s, 512, 4000) for s in range(1, 20_000)]
    assert max(range(len(rates)), key=rates.__getitem__) + 1 == 4000
    assert rates[3999] == pytest.approx(512 ** -0.5 * 4000 ** -0.5)  # ~7.0e-4


def test_optimizer_follows_the_schedule_step_by_step():
    model = torch.nn.Linear(3, 3)
    opt, sched = make_optimizer(model, (0.9, 0.98), 1e-9, d_model=64, warmup_steps=10, scale=1.0)
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["eps"] == 1e-9
    for step in range(1, 25):
        assert opt.param_groups[0]["lr"] == pytest.approx(noam_lr(step, 64, 10))
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("progress, cooldown, expected", [
    (0.0, 0.0, 1.0), (0.99, 0.0, 1.0),          # off: the paper's schedule to the end
    (0.0, 0.2, 1.0), (0.8, 0.2, 1.0),           # before the last 20%
    (0.9, 0.2, 0.5), (0.95, 0.2, 0.25),         # halfway, three quarters down
    (1.0, 0.2, 0.0), (1.3, 0.2, 0.0),           # the end, and past it (a budget overrun)
    (0.0, 1.0, 1.0), (0.25, 1.0, 0.75),         # cooldown over all of training
])
def test_cooldown_falls_linearly_to_zero_over_the_last_fraction(progress, cooldown, expected):
    assert cooldown_factor(progress, cooldown) == pytest.approx(expected)


@pytest.mark.parametrize("steps, max_minutes, step, elapsed_s, started", [
    (10, 0, 5, 0.0, False), (10, 0, 6, 0.0, True),     # past half of 10 steps: from step 7
    (10, 0, 9, 1e9, True),                             # no time budget: the clock is not read
    (100, 1, 5, 30.0, False), (100, 1, 5, 31.0, True),  # the time spent, further on than steps
    (100, 1, 60, 1.0, True),                           # the steps, further on than the time
])
def test_rdrop_starts_past_its_fraction_of_steps_or_time(steps, max_minutes, step, elapsed_s,
                                                         started):
    from types import SimpleNamespace

    from aiayn.training.schedule import schedule_at

    t = SimpleNamespace(steps=steps, max_minutes=max_minutes, cooldown=0.0, rdrop=5.0,
                        rdrop_start=0.5)
    assert schedule_at(t, step, elapsed_s) == {"lr_factor": 1.0, "rdrop_started": started}
    # from the first step (rdrop_start 0) or off (rdrop 0), nothing depends on the end
    for rdrop, start in ((5.0, 0.0), (0.0, 0.5)):
        t.rdrop, t.rdrop_start = rdrop, start
        assert schedule_at(t, step, elapsed_s)["rdrop_started"] is False


def brute_force(logits, labels, eps, pad):
    V = logits.shape[-1]
    total, nll_total, n = 0.0, 0.0, 0
    for row, y in zip(logits.reshape(-1, V), labels.reshape(-1), strict=True):
        if y == pad:
            continue
        logp = torch.log_softmax(row.double(), -1)
        q = torch.full((V,), eps / V, dtype=torch.float64)
        q[y] += 1 - eps
        total += float(-(q * logp).sum())
        nll_total += float(-logp[y])
        n += 1
    return total, nll_total, n


def test_label_smoothing_against_brute_force():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(1, 11, (3, 5))
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    loss, nll, n = label_smoothed_loss(logits, labels, 0.1, pad_id=0)
    exp_loss, exp_nll, exp_n = brute_force(logits, labels, 0.1, 0)
    assert n == exp_n == 15 - 2 - 4
    assert float(loss) == pytest.approx(exp_loss, rel=1e-5)
    assert float(nll) == pytest.approx(exp_nll, rel=1e-5)
    # The same definition as PyTorch's built-in label smoothing.
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=0,
                                            label_smoothing=0.1, reduction="sum")
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)


def test_padding_positions_get_no_gradient():
    logits = torch.randn(2, 4, 7, requires_grad=True)
    labels = torch.tensor([[3, 4, 0, 0], [5, 0, 0, 0]])
    loss, _, _ = label_smoothed_loss(logits, labels, 0.1, pad_id=0)
    loss.backward()
    assert torch.all(logits.grad[labels == 0] == 0)
    assert torch.all(logits.grad[labels != 0].abs().sum(-1) > 0)


def test_no_smoothing_is_plain_nll():
    logits = torch.randn(1, 3, 6)
    labels = torch.tensor([[1, 2, 3]])
    loss, nll, _ = label_smoothed_loss(logits, labels, 0.0, pad_id=0)
    assert float(loss) == pytest.approx(float(nll))


def test_rdrop_loss_is_the_mean_smoothed_loss_plus_a_quarter_alpha_of_both_kls():
    """Against torch's own label-smoothed cross-entropy and KL divergence."""
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 13)
    labels = torch.randint(0, 13, (9,))
    eps, alpha = 0.2, 5.0
    loss, nll = rdrop_loss(logits, labels, eps, alpha)
    ce = [F.cross_entropy(logits[i], labels, label_smoothing=eps, reduction="sum")
          for i in range(2)]
    plain = [F.cross_entropy(logits[i], labels, reduction="sum") for i in range(2)]
    lp = F.log_softmax(logits, dim=-1)
    kl_12 = F.kl_div(lp[1], lp[0], log_target=True, reduction="sum")  # KL(p1 || p2)
    kl_21 = F.kl_div(lp[0], lp[1], log_target=True, reduction="sum")
    assert float(kl_12) > 0.5 and float(kl_21) > 0.5  # the term is not negligible here
    assert float(loss) == pytest.approx(float((ce[0] + ce[1]) / 2 + alpha * (kl_12 + kl_21) / 4),
                                        rel=1e-5)
    assert float(nll) == pytest.approx(float((plain[0] + plain[1]) / 2), rel=1e-5)


def test_rdrop_loss_of_two_equal_passes_is_the_plain_loss_with_its_gradient():
    torch.manual_seed(1)
    logits = torch.randn(7, 11, requires_grad=True)
    labels = torch.randint(0, 11, (7,))
    loss, nll = rdrop_loss(torch.stack([logits, logits]), labels, 0.1, 3.0)
    (grad,) = torch.autograd.grad(loss, logits)
    want, want_nll, _ = label_smoothed_loss(logits, labels, 0.1, pad_id=-1)
    (want_grad,) = torch.autograd.grad(want, logits)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert float(nll.detach()) == pytest.approx(float(want_nll.detach()), rel=1e-6)
    torch.testing.assert_close(grad, want_grad)


def test_rdrop_loss_wants_two_passes_of_every_label():
    with pytest.raises(ValueError, match=r"\(2, N, V\)"):
        rdrop_loss(torch.randn(3, 4, 5), torch.zeros(4, dtype=torch.long), 0.1, 1.0)


# --------------------------------------------------------------------------- criteria


@pytest.mark.parametrize("output_vocab", [False, True], ids=["shared", "target"])
def test_the_criteria_compute_one_loss_four_ways(toy_workspace, output_vocab):
    """Without dropout the fused criterion equals the plain one (fp32 rounding), R-Drop of two
    equal passes is the plain loss (its KL terms are 0), and without gradients R-Drop is its
    base; each is what make_criterion returns for its settings."""
    from aiayn import fast
    from aiayn.data.sampler import ShardDataset
    from aiayn.model import OutputVocab, Transformer, TransformerConfig
    from aiayn.training.objective import (
        FusedLabelSmoothedCrossEntropy,
        FusedRDrop,
        LabelSmoothedCrossEntropy,
        RDrop,
        make_criterion,
    )

    data = ShardDataset(toy_workspace / "data/shards/train")
    batch = data.batch(0)
    vocab = int(data.meta["vocab_size"])
    cfg = TransformerConfig(vocab_size=vocab, d_model=32, heads=4, encoder_layers=1,
                            decoder_layers=1, d_ff=64, dropout=0.0, max_positions=64)
    torch.manual_seed(0)
    plain_model = Transformer(cfg).train()
    fast_model = fast.apply(Transformer(cfg)).train()
    fast_model.load_state_dict(plain_model.state_dict())
    output = None
    if output_vocab:
        ids = torch.unique(torch.cat([batch.tgt_out.reshape(-1), torch.tensor([0])]))
        output = OutputVocab.of(ids, vocab, 0)

    def make(kernels, rdrop, model, fraction=1.0):
        return make_criterion(kernels=kernels, label_smoothing=0.1, rdrop=rdrop, pad_id=0,
                              embedding=model.embedding.weight, output=output,
                              rdrop_fraction=fraction)

    kinds = {("plain", 0.0): LabelSmoothedCrossEntropy, ("fast", 0.0):
             FusedLabelSmoothedCrossEntropy, ("plain", 5.0): RDrop, ("fast", 5.0): FusedRDrop}
    for (kernels, rdrop), kind in kinds.items():
        assert type(make(kernels, rdrop, plain_model)) is kind
    want_loss, want_nll, want_n = make("plain", 0.0, plain_model)(plain_model, batch)
    assert int(want_n) == batch.tgt_tokens
    for kernels, rdrop, fraction, model in (
            ("fast", 0.0, 1.0, fast_model), ("plain", 5.0, 1.0, plain_model),
            ("fast", 5.0, 1.0, fast_model), ("plain", 5.0, 0.5, plain_model),
            ("fast", 5.0, 0.3, fast_model)):
        loss, nll, n = make(kernels, rdrop, model, fraction)(model, batch)
        assert int(n) == int(want_n), (kernels, rdrop)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(nll, want_nll, rtol=1e-5, atol=1e-4)
        with torch.no_grad():  # validation: R-Drop is its base
            again = make(kernels, rdrop, model, fraction)(model, batch)
        torch.testing.assert_close(again[0], want_loss, rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- R-Drop on a share


class CopyAwareNet(torch.nn.Module):
    """Decoder outputs that depend on the token, the source and the row of the stacked batch,
    so that a sentence's second copy (a later row) scores differently from its first; the
    logits are those outputs times the tied matrix ``embedding``, as the model's."""

    def __init__(self, vocab: int, rows: int, d: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.token = torch.nn.Parameter(torch.randn(vocab, d, generator=g))
        self.embedding = torch.nn.Parameter(torch.randn(vocab, d, generator=g))
        self.source = torch.randn(d, generator=g)
        self.row = torch.randn(rows, d, generator=g)

    def hidden_of(self, src_row: torch.Tensor, tgt_token: int, row: int) -> torch.Tensor:
        return self.token[tgt_token] + 0.1 * src_row.sum() * self.source + self.row[row]

    def forward(self, src, tgt_in, packed=None):
        hidden = (self.token[tgt_in] + 0.1 * src.sum(1)[:, None, None] * self.source
                  + self.row[: src.shape[0]].unsqueeze(1))                  # (B', T, d)
        if packed is not None:  # the fast model's packed rows
            return hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed)
        return hidden @ self.embedding.t()


def toy_batch(seed: int = 0):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 6, 2, 4, 6, 1, 3])
    tgt_out = torch.randint(1, 9, (8, 6), generator=g) * (torch.arange(6) < lengths[:, None])
    return SimpleNamespace(src=torch.randint(1, 9, (8, 4), generator=g),
                           tgt_in=torch.randint(1, 9, (8, 6), generator=g), tgt_out=tgt_out,
                           tgt_positions=None)


@pytest.mark.parametrize("kernels", ["plain", "fast"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_rdrop_on_a_share_of_the_batch_is_rdrop_on_the_drawn_sentences_alone(kernels, fraction):
    """Brute force, label by label: a drawn sentence's labels get R-Drop's loss of its two
    rows' logits, every other label the plain label-smoothed loss of its one row; the
    loss, the NLL and the gradients, on the full logits and fused."""
    from aiayn.training.objective import make_criterion

    eps, alpha = 0.1, 4.0
    batch = toy_batch()
    net = CopyAwareNet(vocab=9, rows=16)
    crit = make_criterion(kernels=kernels, label_smoothing=eps, rdrop=alpha, pad_id=0,
                          embedding=net.embedding, rdrop_fraction=fraction)
    torch.manual_seed(7)
    drawn = crit.subset(batch)
    assert drawn is not None and drawn.numel() == max(1, round(fraction * 8))
    torch.manual_seed(7)
    loss, nll, n = crit(net, batch)
    grads = torch.autograd.grad(loss, [net.token, net.embedding])

    want_loss = want_nll = 0.0
    for b in range(8):
        slot = (drawn == b).nonzero()
        for t in range(6):
            label = int(batch.tgt_out[b, t])
            if label == 0:
                continue
            target = torch.tensor([label])
            rows = [b] + ([8 + int(slot)] if slot.numel() else [])
            logits = [(net.hidden_of(batch.src[b], int(batch.tgt_in[b, t]), r)
                       @ net.embedding.t())[None] for r in rows]
            want_loss = want_loss + sum(F.cross_entropy(z, target, label_smoothing=eps)
                                        for z in logits) / len(rows)
            want_nll += sum(float(F.cross_entropy(z.detach(), target)) for z in logits) / len(rows)
            if len(rows) == 2:
                p, q = (F.log_softmax(z, -1) for z in logits)
                want_loss = want_loss + alpha / 4 * ((p.exp() - q.exp()) * (p - q)).sum()
    want_grads = torch.autograd.grad(want_loss, [net.token, net.embedding])
    assert int(n) == int((batch.tgt_out != 0).sum())
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert float(nll) == pytest.approx(want_nll, rel=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_rdrop_draws_a_new_share_each_step_and_all_of_the_batch_at_one():
    from aiayn.training.objective import LabelSmoothedCrossEntropy, RDrop

    batch = toy_batch()
    base = LabelSmoothedCrossEntropy(label_smoothing=0.1, pad_id=0)
    torch.manual_seed(0)
    draws = {tuple(RDrop(base=base, alpha=1.0, fraction=0.5).subset(batch).tolist())
             for _ in range(20)}
    assert len(draws) > 5 and all(len(d) == 4 and list(d) == sorted(d) for d in draws)
    assert RDrop(base=base, alpha=1.0, fraction=1.0).subset(batch) is None
    assert RDrop(base=base, alpha=1.0, fraction=0.99).subset(batch) is None  # rounds to 8 of 8
    assert RDrop(base=base, alpha=1.0, fraction=0.01).subset(batch).numel() == 1
