"""model.output_vocab: target — the softmax spans the tokens of the target side only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from aiayn.data.sampler import Batch, BatchLoader, ShardDataset, TokenBudgetSampler
from aiayn.data.subword import NO_PARENT, SubwordSplitter, merge_parents, split_closure
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_tokenizer
from aiayn.decoding.beam import BeamConfig, beam_search, greedy_search
from aiayn.decoding.translation import source_batch
from aiayn.fast import apply as apply_kernels
from aiayn.model import OutputVocab, Transformer, TransformerConfig
from aiayn.training.build import target_vocabulary
from aiayn.training.checkpoint import average_checkpoints, list_checkpoints, load_checkpoint
from aiayn.training.objective import make_criterion
from tests.test_training import make_trainer

V = 40


def batch_loss(net, embedding, batch, label_smoothing, pad_id, fast, amp_dtype, output=None,
               pack=True, rdrop=0.0):
    """One batch's (loss, NLL, labels) through the criterion the trainer would choose, and
    with ``fast`` its kernels, applied to ``net`` in place as the trainer applies them (the
    fused criterion runs the decoder on the real positions only, which the fast model does)."""
    if fast:
        apply_kernels(net)
    return make_criterion(kernels="fast" if fast else "plain", label_smoothing=label_smoothing,
                          rdrop=rdrop, pad_id=pad_id, embedding=embedding, amp_dtype=amp_dtype,
                          output=output, pack=pack)(net, batch)


def tiny(output_vocab: str = "target", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=V, d_model=16, heads=2, encoder_layers=1,
                            decoder_layers=2, d_ff=32, dropout=0.0, max_positions=32,
                            output_vocab=output_vocab)
    return Transformer(cfg)


# A subset of the 40 ids: PAD and EOS, some content tokens; BOS (1) and the rest left out.
SPANNED = torch.tensor([PAD_ID, EOS_ID, 5, 6, 9, 12, 13, 20, 21, 22, 30, 33, 37])


def a_batch(labels_from: torch.Tensor) -> Batch:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, V, (3, 7), generator=g)
    src[0, 5:] = PAD_ID
    content = labels_from[labels_from > EOS_ID]
    tgt = content[torch.randint(0, content.numel(), (3, 6), generator=g)]
    lengths = [6, 4, 2]
    tgt_out = torch.full((3, 7), PAD_ID)
    tgt_in = torch.full((3, 7), PAD_ID)
    for i, n in enumerate(lengths):
        tgt_out[i, :n] = tgt[i, :n]
        tgt_out[i, n] = EOS_ID
        tgt_in[i, 0] = BOS_ID
        tgt_in[i, 1:n + 1] = tgt[i, :n]
    return Batch(src, tgt_in, tgt_out, torch.arange(3), int((src != PAD_ID).sum()),
                 int((tgt_out != PAD_ID).sum()))


def test_split_closure_adds_every_part_down_to_single_tokens():
    parents = np.full((8, 2), NO_PARENT)
    parents[7] = (5, 6)  # 7 = 5 + 6
    parents[5] = (3, 4)  # 5 = 3 + 4
    seen = np.zeros(8, dtype=bool)
    seen[[2, 7]] = True
    assert np.flatnonzero(split_closure(seen, parents)).tolist() == [2, 3, 4, 5, 6, 7]
    assert seen.sum() == 2  # its input is left as it was


def test_the_target_vocabulary_is_every_label_of_the_train_and_valid_batches(toy_workspace):
    shards = toy_workspace / "data/shards"
    data = [ShardDataset(shards / "train"), ShardDataset(shards / "valid")]
    labels = {PAD_ID}
    for ds in data:  # built another way: the labels of every batch the loader would make
        for i in range(ds.num_batches):
            labels |= set(ds.batch(i).tgt_out.unique().tolist())
    ids = target_vocabulary(data, PAD_ID, BOS_ID)
    assert ids.tolist() == sorted(labels)
    assert EOS_ID in labels and BOS_ID not in labels
    # Not vacuous: the shared vocabulary holds tokens that never occur on the target side.
    assert len(ids) < int(data[0].meta["vocab_size"]) - 50


def test_with_subword_splitting_it_holds_every_token_a_split_batch_can_have(toy_workspace):
    shards = toy_workspace / "data/shards"
    train, valid = ShardDataset(shards / "train"), ShardDataset(shards / "valid")
    parents = merge_parents(load_tokenizer(toy_workspace / "data/vocab/tokenizer.json"))
    plain = set(target_vocabulary([train, valid], PAD_ID, BOS_ID).tolist())
    closed = set(target_vocabulary([train, valid], PAD_ID, BOS_ID, parents).tolist())
    loader = iter(BatchLoader(train, TokenBudgetSampler(train.num_batches, 0, 1, seed=3),
                              splitter=SubwordSplitter(parents, 0.5, seed=3, max_len=256)))
    split_labels = set()
    for _ in range(3 * train.num_batches):
        split_labels |= set(next(loader).tgt_out.unique().tolist())
    assert split_labels <= closed
    assert not split_labels <= plain  # splitting does yield tokens the text never holds


@pytest.mark.parametrize("fast,pack", [(True, True), (True, False), (False, True)])
def test_the_loss_spans_the_output_vocabulary_only(fast, pack):
    """Fast and plain paths, the fast one with its decoder on the real positions only or on
    the padded batch, against the label-smoothed loss written out over the spanned
    columns: smoothing's uniform share spread over them, not over the whole vocabulary."""
    model = tiny()
    model.set_output_vocab(SPANNED)
    batch = a_batch(SPANNED)
    output = model.output_vocab()
    assert torch.equal(output.ids, torch.as_tensor(SPANNED).sort().values)
    eps = 0.1
    loss, nll, n = batch_loss(model, model.embedding.weight, batch, eps, PAD_ID, fast, None,
                              output, pack=pack)
    loss.backward()
    got = model.embedding.weight.grad.clone()
    model.zero_grad()

    hidden = model(batch.src, batch.tgt_in, hidden=True)
    lp = F.log_softmax(hidden @ model.embedding.weight[SPANNED].t(), dim=-1)
    column = {int(t): i for i, t in enumerate(SPANNED)}
    want, want_nll = 0.0, 0.0
    for (b, t), label in np.ndenumerate(batch.tgt_out.numpy()):
        if label != PAD_ID:
            row = lp[b, t]
            want = want + (1 - eps) * -row[column[int(label)]] - eps * row.mean()
            want_nll += float(-row[column[int(label)]].detach())
    want.backward()
    assert int(n) == int((batch.tgt_out != PAD_ID).sum())
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(nll.detach()) == pytest.approx(want_nll, rel=1e-5)
    torch.testing.assert_close(got, model.embedding.weight.grad, rtol=1e-4, atol=1e-6)
    # Rows outside the output vocabulary get no gradient from the projection: those that no
    # input of the batch embeds either have none at all.
    unused = sorted(set(range(4, V)) - set(SPANNED.tolist()) - set(batch.src.unique().tolist()))
    assert unused and got[unused].abs().max() == 0


def test_decoding_never_leaves_the_output_vocabulary():
    model = tiny().eval()
    src = source_batch([[4, 8, 15, 16, 23], [7, 11, 19]])
    cfg = BeamConfig(beam=3, max_len_a=0.0, max_len_b=12)
    # Not vacuous: the same weights spanning the whole vocabulary leave the subset.
    whole = {t for out in greedy_search(model, src, max_len_a=0.0, max_len_b=12) for t in out}
    assert not whole <= set(SPANNED.tolist())
    model.set_output_vocab(SPANNED)
    for outputs in (greedy_search(model, src, max_len_a=0.0, max_len_b=12),
                    beam_search(model, src, cfg)):
        assert {t for out in outputs for t in out} <= set(SPANNED.tolist())


@pytest.mark.parametrize("beam,alpha", [(1, 0.0), (4, 0.6)])
def test_decoding_projects_onto_the_spanned_rows_and_finds_what_the_masked_logits_find(
        beam, alpha):
    """Decoding computes the logits of the spanned tokens only (their rows of the shared
    matrix), and finds the same outputs as the whole-vocabulary logits with the others at
    -inf, which it computed before (``spanned_only=False``), and as the
    no-cache recompute path."""
    model = tiny(seed=3).eval()
    model.set_output_vocab(SPANNED)
    src = source_batch([[4, 8, 15, 16, 23], [7, 11, 19], [25, 26, 27, 28, 29, 31, 32]])
    cfg = BeamConfig(beam=beam, alpha=alpha, max_len_a=0.0, max_len_b=12)
    widths, step = [], model.decode_step

    def decode_step(tokens, state, projection=None):
        out = step(tokens, state, projection)
        widths.append(out.shape[-1])
        return out

    model.decode_step = decode_step
    spanned = beam_search(model, src, cfg)
    assert widths and set(widths) == {len(SPANNED)}  # never the whole vocabulary's V
    widths.clear()
    masked = beam_search(model, src, cfg, spanned_only=False)  # the masked whole vocabulary
    assert set(widths) == {V}
    del model.decode_step
    assert spanned == masked == beam_search(model, src, cfg, use_cache=False)
    assert any(len(out) > 1 for out in spanned)  # sentences, not just EOS


def test_set_output_vocab_is_checked():
    with pytest.raises(ValueError, match="output_vocab='target'"):
        tiny("shared").set_output_vocab(SPANNED)
    with pytest.raises(ValueError, match="subset of 0..39"):
        tiny().set_output_vocab(torch.tensor([0, 40]))
    with pytest.raises(ValueError, match="output_vocab must be"):
        TransformerConfig(vocab_size=V, output_vocab="source")
    with pytest.raises(ValueError, match="padding id"):
        OutputVocab.of(torch.tensor([2, 5]), V, PAD_ID).loss_labels(torch.tensor([[2, 5]]))


def test_a_run_keeps_its_output_vocabulary_through_checkpoints_and_averaging(toy_workspace,
                                                                             tmp_path):
    trainer = make_trainer(toy_workspace, tmp_path / "run",
                           {"model": {"output_vocab": "target"}})
    summary = trainer.fit()
    shards = toy_workspace / "data/shards"
    expected = target_vocabulary([ShardDataset(shards / "train"),
                                  ShardDataset(shards / "valid")], PAD_ID, BOS_ID)
    assert np.isfinite(summary["valid_loss"])
    assert summary["output_vocab"] == "target"
    assert summary["output_vocab_size"] == len(expected)
    found = list_checkpoints(tmp_path / "run/checkpoints")
    for state in (load_checkpoint(found[-1])["model"], average_checkpoints(found[-3:])):
        bias = state["output_bias"]
        assert torch.equal(torch.nonzero(bias == 0).squeeze(1), torch.from_numpy(expected))
        assert bool(torch.isneginf(bias[bias != 0]).all())
    # A resumed trainer restores it from the checkpoint and trains on the same columns.
    again = make_trainer(toy_workspace, tmp_path / "run", {"model": {"output_vocab": "target"}})
    assert again.state.step == summary["steps"]
    assert torch.equal(again.model.output_vocab().ids, torch.from_numpy(expected))


def dropped(seed: int = 0, dropout: float = 0.3) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=V, d_model=16, heads=2, encoder_layers=1,
                            decoder_layers=2, d_ff=32, dropout=dropout, max_positions=32,
                            output_vocab="target")
    model = Transformer(cfg)
    model.set_output_vocab(SPANNED)
    return model


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_rdrop_without_dropout_is_the_plain_loss_and_gradient(fast):
    """Two passes without dropout are the same pass: the KL term is 0, and the loss, NLL and
    gradients are the plain step's."""
    model = dropped(dropout=0.0)
    batch = a_batch(SPANNED)
    got = {}
    for rdrop in (0.0, 4.0):
        loss, nll, n = batch_loss(model, model.embedding.weight, batch, 0.1, PAD_ID, fast, None,
                                  model.output_vocab(), rdrop=rdrop)
        loss.backward()
        got[rdrop] = (loss.detach(), nll.detach(), int(n),
                      {k: q.grad.clone() for k, q in model.named_parameters()})
        model.zero_grad()
    torch.testing.assert_close(got[4.0][0], got[0.0][0])
    torch.testing.assert_close(got[4.0][1], got[0.0][1])
    assert got[4.0][2] == got[0.0][2] == int((batch.tgt_out != PAD_ID).sum())
    for name, grad in got[0.0][3].items():
        torch.testing.assert_close(got[4.0][3][name], grad, msg=name)


def test_rdrop_with_dropout_against_the_doubled_batch_written_out():
    """Plain path: the loss is rdrop's formula over the padded logits of the batch stacked on
    itself, from the same draws, spanned columns only; the two copies differ."""
    model = dropped()
    batch = a_batch(SPANNED)
    eps, alpha = 0.1, 3.0
    torch.manual_seed(7)
    loss, nll, n = batch_loss(model, model.embedding.weight, batch, eps, PAD_ID, False, None,
                              model.output_vocab(), rdrop=alpha)
    torch.manual_seed(7)
    logits = model(torch.cat([batch.src, batch.src]), torch.cat([batch.tgt_in, batch.tgt_in]))
    lp = F.log_softmax(logits[..., SPANNED.sort().values], dim=-1).detach()
    column = {int(t): i for i, t in enumerate(SPANNED.sort().values)}
    B = batch.src.shape[0]
    want = want_nll = 0.0
    for (b, t), label in np.ndenumerate(batch.tgt_out.numpy()):
        if label == PAD_ID:
            continue
        p1, p2 = lp[b, t], lp[B + b, t]
        y = column[int(label)]
        smoothed = [(1 - eps) * -p[y] - eps * p.mean() for p in (p1, p2)]
        kl = ((p1.exp() - p2.exp()) * (p1 - p2)).sum()
        assert float(kl) > 0  # independent dropout for each copy
        want += float((smoothed[0] + smoothed[1]) / 2 + alpha * kl / 4)
        want_nll += float((-p1[y] - p2[y]) / 2)
    assert int(n) == int((batch.tgt_out != PAD_ID).sum())
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert float(nll.detach()) == pytest.approx(want_nll, rel=1e-5)


def test_rdrop_on_the_fast_path_compares_two_different_passes():
    """Fast path (packed rows): from the same draws, the loss grows with alpha by the KL
    term, which is > 0, so the second copy's rows are its own pass, not the first's again."""
    model = dropped()
    batch = a_batch(SPANNED)
    losses = []
    for alpha in (1.0, 3.0):
        torch.manual_seed(7)
        loss, _, _ = batch_loss(model, model.embedding.weight, batch, 0.1, PAD_ID, True, None,
                                model.output_vocab(), rdrop=alpha)
        losses.append(float(loss.detach()))
    kl = 4 * (losses[1] - losses[0]) / 2.0
    assert kl > 1e-3 * losses[0]
