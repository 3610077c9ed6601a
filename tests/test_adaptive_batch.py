"""Adaptive per-rank batches: the shares' decision, the loader's units and their exact resume, the settings
refused, and a 2-rank run in which a rank slowed 2x is given less. The losses' exactness with uneven rows is in
tests/test_uneven_rows.py."""

import itertools
import json
from itertools import islice

import pytest
import torch
from test_data import decode, write_set

from conftest import REPO, read_metrics, tiny_config
from mmpt.config_loader import load_config
from mmpt.data.loader import BatchStream, Source, StatefulLoader, StreamSpec
from mmpt.engine.resilience.adaptive_batch import (
    WINDOWS_PER_DECISION,
    BatchShares,
    check_adaptive_batch,
    cost_model,
    fastest_shares,
    step_time,
)
from mmpt.errors import ConfigError
from pool import scenario


@pytest.mark.parametrize(
    "costs, total, most",
    [
        ([(0.0, 1.0), (0.0, 2.0)], 8, 8),
        ([(0.0, 1.0), (0.0, 3.0), (0.0, 1.5)], 12, 6),
        ([(0.0, 1.0), (0.0, 1.0), (0.0, 10.0)], 9, 4),
        ([(2.0, 1.0), (4.0, 2.0)], 16, 12),  # a slow rank's fixed part is slow too
    ],
)
def test_the_shares_finish_the_slowest_rank_soonest_within_bounds(costs, total, most):
    shares = fastest_shares(costs, total, most)
    assert sum(shares) == total and all(1 <= units <= most for units in shares)
    # against every split there is
    splits = [s for s in itertools.product(range(1, most + 1), repeat=len(costs)) if sum(s) == total]
    assert step_time(shares, costs) == pytest.approx(min(step_time(s, costs) for s in splits))


def test_the_cost_of_a_rank_is_fitted_once_it_ran_at_two_shares():
    assert cost_model({4: [2.0, 2.2]}, 4) == pytest.approx((0.0, 0.525))  # proportional at first
    assert cost_model({4: [3.0], 6: [4.0]}, 6) == pytest.approx((1.0, 0.5))  # busy = 1 + 0.5 per unit
    assert cost_model({4: [3.0], 6: [2.9]}, 6) == pytest.approx((0.0, 2.9 / 6))  # noise, not a slope: proportional


def windows(shares: BatchShares, busy: list[float], count: int = WINDOWS_PER_DECISION) -> list[bool]:
    return [shares.update(busy) for _ in range(count)]


def test_a_rank_twice_as_busy_gets_less_and_noise_changes_nothing():
    shares = BatchShares(ranks=2, rank=1, per_rank=4, unit=8, max_share=2.0)
    assert not shares.update([1.0, 2.0])  # the first window holds start-up work
    assert windows(shares, [1.0, 1.03]) == [False] * 3  # 3% apart: not worth a change
    assert windows(shares, [1.0, 1.0], 2) + [shares.update([1.0, 2.0])] == [False] * 3  # 1 disturbed window
    assert shares.units == [4, 4] and shares.loss_weight() == 1.0
    assert windows(shares, [1.0, 2.0]) == [False, False, True]  # decided on the median of 3 windows
    assert shares.units == [5, 3] or shares.units == [6, 2]
    assert shares.samples() == [8 * u for u in shares.units]
    weights = [BatchShares(2, r, 4, 8, 2.0) for r in (0, 1)]
    for part in weights:
        part.load_state_dict(json.loads(json.dumps(shares.state_dict())))
    for rank, part in enumerate(weights):  # ranks x its share of the global batch
        assert part.loss_weight() == pytest.approx(2 * part.samples()[rank] / sum(part.samples()))


def test_a_very_slow_rank_keeps_one_unit_and_the_others_stay_under_their_bound():
    shares = BatchShares(ranks=3, rank=0, per_rank=4, unit=2, max_share=1.5)
    shares.update([1.0, 1.0, 1.0])
    windows(shares, [1.0, 1.0, 50.0])
    assert shares.units == [6, 5, 1] or shares.units == [5, 6, 1]


def test_settings_it_cannot_work_with_are_refused_in_one_line():
    base = [f"run.output_dir={REPO / 'unused'}", "train.adaptive_batch=true"]
    config = REPO / "configs/clip/demo.yaml"
    check_adaptive_batch(load_config(config, base))  # the defaults work with the demo's batch
    with pytest.raises(ConfigError, match=r"'train.adaptive_batch_units': 7 does not divide data.train.batch_size"):
        check_adaptive_batch(load_config(config, [*base, "train.adaptive_batch_units=7"]))
    with pytest.raises(ConfigError, match=r"'train.adaptive_batch': not supported with train.sequence_parallel=2"):
        check_adaptive_batch(load_config(config, [*base, "train.sequence_parallel=2"]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_units_taken_unevenly_resume_sample_exact(tmp_path, num_workers):
    pattern = write_set(tmp_path, n=60, per_shard=6)

    def loader():
        spec = StreamSpec(
            [Source.from_pattern(pattern)], batch_size=8, seed=3, shuffle_buffer=7, num_workers=num_workers
        )
        reader = StatefulLoader(BatchStream(spec, decode))
        reader.read_in_units(2)
        return reader

    takes = [3, 5, 1, 4, 2, 6, 3]

    def read(reader, counts):
        items = iter(reader)
        return [reader.combine(list(islice(items, n))) for n in counts]

    reference = read(loader(), takes)
    assert [len(batch["id"]) for batch in reference] == [2 * n for n in takes]
    first = loader()
    head = read(first, takes[:4])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader()
    resumed.load_state_dict(state)
    tail = read(resumed, takes[4:])
    for key in ("id", "augment"):
        torch.testing.assert_close(torch.cat([b[key] for b in head + tail]), torch.cat([b[key] for b in reference]))
    if num_workers == 0:  # one reader: the same samples, in the same order, as batches of the same total
        whole = StatefulLoader(
            BatchStream(StreamSpec([Source.from_pattern(pattern)], 2, seed=3, shuffle_buffer=7), decode)
        )
        plain = list(islice(whole, sum(takes)))
        torch.testing.assert_close(
            torch.cat([b["augment"] for b in reference]), torch.cat([b["augment"] for b in plain])
        )


@scenario("adaptive-slowed", fault="slow_compute:rank=1:factor=2")
def slowed_rank(corpora, run_dir):
    settings = dict(zero_stage=2, max_steps=9, save_every=4, log_every=1, adaptive_batch=True, adaptive_batch_units=4)
    return tiny_config(corpora["digits"], run_dir, train=settings), [], "stop_at:7"


@pytest.mark.pool("adaptive-slowed")
def test_a_rank_slowed_twice_is_given_a_smaller_share(rank_pool):
    """2 ranks, rank 1's work slowed 2x: after the first windows its micro-batch shrinks, rank 0's grows, the
    global batch stays, and the run finishes (7 steps); then resumed for two more steps."""
    records = [r for r in read_metrics(rank_pool.run_dir("adaptive-slowed")) if "micro_batch_per_rank" in r]
    shares = [r["micro_batch_per_rank"] for r in records if r["step"] <= 7]
    assert shares[0] == [16, 16] and all(sum(s) == 32 for s in shares), shares
    assert shares[-1][0] > shares[-1][1], shares
    # The resumed start's first step: the saved shares carry on (no decision was due at the last window, and the
    # next is due only after a few windows' measurement).
    resumed = [r["micro_batch_per_rank"] for r in records if r["step"] == 8]
    assert resumed == [shares[-1]], (resumed, shares)
