"""aiayn.data.batching: a step's token budget split over processes, and micro-batches planned from
the shards' sorted pairs when training starts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from aiayn.config import ShardConfig, parse_params
from aiayn.data.batching import pair_costs, plan_step, plan_stored_batches
from aiayn.data.sampler import ShardDataset
from aiayn.data.shards import build_shards
from aiayn.errors import ParamsError
from tests.conftest import REPO, TINY_PARAMS, merge


def test_the_step_plan_keeps_the_budget_on_any_number_of_processes():
    # the paper's step: one micro-batch per GPU by default, capped ones where asked
    assert plan_step(25_000, 1) == plan_step(25_000, 1, 0)
    assert (plan_step(25_000, 1).accumulation, plan_step(25_000, 1).batch_tokens) == (1, 25_000)
    assert (plan_step(25_000, 8).accumulation, plan_step(25_000, 8).batch_tokens) == (1, 3125)
    assert (plan_step(25_000, 1, 6250).accumulation, plan_step(25_000, 1, 6250).batch_tokens) \
        == (4, 6250)
    assert (plan_step(25_000, 2, 6250).accumulation, plan_step(25_000, 2, 6250).batch_tokens) \
        == (2, 6250)
    assert (plan_step(25_000, 3, 4096).accumulation, plan_step(25_000, 3, 4096).batch_tokens) \
        == (3, 2778)  # 9 micro-batches of 2,778: 25,002, not 3 x 3 x 4,096 = 36,864
    # brute force: the capacity is the budget up to a token per micro-batch, the cap holds,
    # and no fewer micro-batches of the cap would reach the budget
    for tokens in (320, 4096, 8192, 25_000, 25_600, 100_003):
        for world in range(1, 17):
            for cap in (0, *range(max(1, tokens // 40), 2 * tokens, max(1, tokens // 37))):
                plan = plan_step(tokens, world, cap)
                micro = world * plan.accumulation
                assert tokens <= plan.capacity < tokens + micro, (tokens, world, cap)
                if cap == 0:
                    assert plan.accumulation == 1
                    assert plan.batch_tokens == math.ceil(tokens / world)
                else:
                    assert plan.batch_tokens <= cap
                    assert (plan.accumulation - 1) * world * cap < tokens
    with pytest.raises(ValueError):
        plan_step(0, 1)
    assert plan_step(25_000, 8).describe() == (
        "8 process(es) x 1 micro-batch(es) of <= 3,125 tokens per step "
        "(train.tokens_per_step 25,000)")


@pytest.fixture(scope="module")
def many_shards(toy_workspace, tmp_path_factory) -> Path:
    """The toy workspace's pairs stored in several shards (a batch never spans two)."""
    out = tmp_path_factory.mktemp("shards") / "shards"
    p = yaml.safe_load((toy_workspace / "params.yaml").read_text())
    build_shards(toy_workspace / "data/survey", toy_workspace / "data/vocab/tokenizer.json", out,
                 ShardConfig(max_tokens=160, max_len=48, shard_tokens=1500),
                 p["data"]["src_lang"], p["data"]["tgt_lang"])
    return out


def test_at_the_shard_stages_budget_the_plan_is_the_one_it_stored(many_shards):
    data = ShardDataset(many_shards / "train")
    assert len(data.meta["shards"]) > 2 and not data.planned
    stored = np.load(many_shards / "train/batches.npy")
    assert np.array_equal(data.plan_batches(160), stored)
    planned = ShardDataset(many_shards / "train", max_tokens=160)
    assert planned.planned and np.array_equal(planned.batches, stored)
    for i in (0, planned.num_batches - 1):
        a, b = data.batch(i), planned.batch(i)
        assert a.src.equal(b.src) and a.tgt_out.equal(b.tgt_out) and a.rows.equal(b.rows)


@pytest.mark.parametrize("budget", [48, 80, 160, 333, 1000, 100_000])
def test_planned_batches_cover_every_pair_once_in_order_and_are_greedy(many_shards, budget):
    data = ShardDataset(many_shards / "train")
    if budget < data.longest_pair():
        with pytest.raises(ValueError, match="cannot hold its longest pair"):
            data.replan(budget)
        return
    table = ShardDataset(many_shards / "train", max_tokens=budget).batches
    costs = [pair_costs(s["src_offsets"], s["tgt_offsets"]) for s in data.shards]
    seen = []
    for k, start, end in table.tolist():
        src, tgt = costs[k]
        assert 0 <= start < end <= src.size
        n = end - start
        assert n * src[start:end].max() <= budget and n * tgt[start:end].max() <= budget
        if end < src.size:  # greedy: the shard's next pair would not have fitted
            m = n + 1
            assert m * src[start:end + 1].max() > budget or m * tgt[start:end + 1].max() > budget
        seen.append((k, start, end))
    # consecutive, shard by shard, every stored row once
    for k, (src, _) in enumerate(costs):
        rows = [(s, e) for kk, s, e in seen if kk == k]
        assert rows[0][0] == 0 and rows[-1][1] == src.size
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))


def test_the_longest_pair_is_the_smallest_budget_that_plans(many_shards):
    data = ShardDataset(many_shards / "train")
    longest = data.longest_pair()
    src, tgt = zip(*[pair_costs(s["src_offsets"], s["tgt_offsets"]) for s in data.shards],
                   strict=True)
    assert longest == max(max(int(x.max()) for x in src), max(int(x.max()) for x in tgt))
    data.replan(longest)  # every pair alone at worst
    with pytest.raises(ValueError):
        data.replan(longest - 1)
    # an empty table where there are no shards
    assert plan_stored_batches([], 100).shape == (0, 3)


def test_a_pickled_dataset_keeps_its_plan(many_shards):
    import pickle

    planned = ShardDataset(many_shards / "train", max_tokens=333)
    again = pickle.loads(pickle.dumps(planned))
    assert again.planned and np.array_equal(again.batches, planned.batches)
    plain = pickle.loads(pickle.dumps(ShardDataset(many_shards / "train")))
    assert not plain.planned and plain.max_tokens == 160


def test_a_micro_batch_cap_below_a_pair_of_max_len_is_refused():
    raw = merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY_PARAMS)
    with pytest.raises(ParamsError) as err:
        parse_params(merge(raw, {"train": {"max_tokens": 40}}), "params.yaml")
    assert "train.max_tokens (40) cannot hold a pair of shard.max_len (48)" in str(err.value)
    assert "at least 49" in str(err.value)
    parse_params(merge(raw, {"train": {"max_tokens": 49}}), "params.yaml")
    parse_params(merge(raw, {"train": {"max_tokens": 0}}), "params.yaml")
