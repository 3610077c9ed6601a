"""Rank health: the collective clock, the judgement that tells a late rank from slow collectives, the
injected slowdowns, and 2-rank runs (the shared pool of ranks; two nodes with torchrun) in which each fault is
named."""

import json
import time
from pathlib import Path

import faults
import pytest
import torch

from conftest import REPO, launcher_env, read_metrics, tiny_config, train_in_process, write_config
from mmpt.config import TrainConfig
from mmpt.engine import stops
from mmpt.engine.resilience import collective_timing, health
from mmpt.engine.resilience.health import HealthMonitor, RankRow, Thresholds, judge
from pool import scenario

REST = [0.0] * 3 * len(collective_timing.KINDS)  # per kind: seconds, calls, MiB
THRESHOLDS = Thresholds(busy_factor=1.5, collective_factor=2.0, min_share=0.05, windows=3)


def rows_for(busy: list[float], arrival: list[float], returned: list[float], calls: int = 10) -> list[RankRow]:
    """Windows of 1 s in which each rank spent `1 - busy` in collectives."""
    return [RankRow(1.0, 1.0 - b, calls, a, r) for b, a, r in zip(busy, arrival, returned)]


def test_a_rank_with_twice_the_busy_time_is_a_straggler_and_its_returns_are_not_late():
    # rank 1 computes twice as long: it arrives last; every rank's calls return together
    rows = rows_for(busy=[0.3, 0.6, 0.3, 0.3], arrival=[0.2, 0.5, 0.2, 0.21], returned=[0.52, 0.52, 0.52, 0.52])
    assert [(f.kind, f.rank) for f in judge(rows, THRESHOLDS)] == [("straggler", 1)]


def test_a_rank_whose_calls_return_late_has_slow_collectives_though_no_busier():
    # rank 2's calls return 50 ms after its peers' (so it also arrives late by as much): busy alike
    rows = rows_for(busy=[0.4] * 4, arrival=[0.30, 0.30, 0.35, 0.30], returned=[0.352, 0.352, 0.402, 0.352])
    found = judge(rows, THRESHOLDS)
    assert [(f.kind, f.rank) for f in found] == [("slow collectives", 2)]
    assert found[0].value == pytest.approx(0.052) and found[0].peer_median == pytest.approx(0.002)


def test_small_lags_and_equal_ranks_are_healthy():
    assert judge(rows_for([0.4, 0.41], [0.3, 0.3], [0.302, 0.302]), THRESHOLDS) == []
    # 3x its peer's return lag, but 10 calls x 2 ms is 2% of the window: below unhealthy_min_share
    assert judge(rows_for([0.4, 0.4], [0.3, 0.3], [0.301, 0.303]), THRESHOLDS) == []
    assert judge(rows_for([0.4], [0.3], [0.31]), THRESHOLDS) == []  # one rank has no peers


class Clock:
    """Stands in for the collective clock: hands out the window a test sets."""

    def __init__(self):
        self.window = collective_timing.Window(1.0, 0.5, 10, 0.3, 0.35)

    def take(self):
        return self.window

    def mark_reference(self):
        pass


def monitor(tmp_path, action="warn") -> HealthMonitor:
    return HealthMonitor(Clock(), THRESHOLDS, action, tmp_path, [("gpu07", 0), ("gpu08", 1)])  # type: ignore[arg-type]


def test_a_rank_is_named_after_windows_in_a_row_and_the_file_names_its_node(tmp_path, monkeypatch):
    late = [[1.0, 0.2, 10, 0.5, 0.52] + REST, [1.0, 0.8, 10, 0.2, 0.52] + REST]  # rank 0 busy 0.8 vs 0.2
    monkeypatch.setattr(health.mdist, "all_gather_floats", lambda row: late)
    watcher = monitor(tmp_path)
    for step in (1, 2):
        watcher.window(step)
        watcher.act(step)
        assert not (tmp_path / "unhealthy.json").exists(), step
    watcher.reached("checkpoint", 3)  # a window with a checkpoint is not judged, and does not break the streak
    watcher.window(3)
    watcher.act(3)
    assert not (tmp_path / "unhealthy.json").exists()
    record = watcher.window(4)
    watcher.act(4)
    report = json.loads((tmp_path / "unhealthy.json").read_text())
    assert report["nodes"] == ["gpu07"] and report["step"] == 4
    assert report["ranks"][0]["kind"] == "straggler" and report["ranks"][0]["rank"] == 0
    assert report["ranks"][0]["line"].startswith("straggler: rank 0 on node gpu07 arrives late")
    assert watcher.summary()["stragglers"] == {"0": 4.0}
    assert record["busy_time_per_rank"] == [0.8, 0.2]


def test_stop_raises_the_unhealthy_stop_with_its_exit_code(tmp_path, monkeypatch):
    slow = [[1.0, 0.5, 10, 0.3, 0.30] + REST, [1.0, 0.5, 10, 0.35, 0.40] + REST]
    monkeypatch.setattr(health.mdist, "all_gather_floats", lambda row: slow)
    monkeypatch.setattr(health.mdist, "get_rank", lambda: 1)  # not rank 0: raises alike, writes nothing
    watcher = monitor(tmp_path, action="stop")
    watcher.window(1)
    watcher.act(1)
    watcher.window(2)
    watcher.act(2)
    watcher.window(3)
    with pytest.raises(health.UnhealthyRankError, match="slow collectives: rank 1 on node gpu08") as caught:
        watcher.act(3)
    assert stops.ending(caught.value, rank=0).exit_code == stops.EXIT_UNHEALTHY == 76
    assert not (tmp_path / "unhealthy.json").exists()


def test_the_clock_times_calls_once_and_counts_bytes(monkeypatch):
    clock = collective_timing.CollectiveClock(cuda=False)
    inner = lambda tensor, group=None: time.sleep(0.01)
    outer = lambda tensor, group=None: clock.call("all_reduce", inner, (tensor,), {"group": group})
    clock.call("all_reduce", outer, (torch.zeros(4),), {})  # DeepSpeed's backend calling torch.distributed
    window = clock.take()
    assert window.sync_calls == 1
    totals = window.kind_totals("all_reduce")
    assert (totals.calls, totals.bytes) == (1, 16.0) and totals.seconds >= 0.01
    assert window.mean_return - window.mean_arrival == pytest.approx(totals.seconds)


def test_slow_collectives_delay_is_timed_with_the_call(monkeypatch):
    monkeypatch.setattr(collective_timing, "_DELAYS", [])
    injector = faults.FaultInjector([], rank=1, slowdowns=faults.parse_slowdowns("slow_collectives:rank=1:delay=0.02"))
    clock = collective_timing.CollectiveClock(cuda=False)
    clock.call("barrier", lambda: None, (), {})
    assert clock.take().collective_seconds >= 0.02
    assert injector.faults == []
    assert faults.FaultInjector([], rank=0, slowdowns=faults.parse_slowdowns("slow_collectives:rank=1")).faults == []
    assert collective_timing._DELAYS and len(collective_timing._DELAYS) == 1  # rank 0 added none
    injector.close()  # the pool of ranks trains other runs in this process next
    clock.call("barrier", lambda: None, (), {})
    assert collective_timing._DELAYS == [] and clock.take().collective_seconds < 0.02


def test_slow_compute_stretches_the_work_between_points_and_up_to_each_collective(monkeypatch):
    monkeypatch.setattr(collective_timing, "_LATE_STARTS", [])
    injector = faults.FaultInjector([], rank=1, slowdowns=faults.parse_slowdowns("slow_compute:rank=1:factor=3"))
    injector.reached("forward", 1)
    time.sleep(0.02)
    started = time.perf_counter()
    injector.reached("backward", 1)
    assert time.perf_counter() - started >= 0.04  # (3 - 1) x the 20 ms since the previous point
    # A collective inside backward (a bucketed reduction) starts late by as much, outside its own timing.
    clock = collective_timing.CollectiveClock(cuda=False)
    time.sleep(0.02)
    started = time.perf_counter()
    clock.call("all_reduce", lambda: None, (), {})
    assert time.perf_counter() - started >= 0.04 and clock.take().collective_seconds < 0.02
    injector.reached("checkpoint", 1)  # checkpoints break the chain: their collectives are not stretched
    time.sleep(0.02)
    started = time.perf_counter()
    clock.call("barrier", lambda: None, (), {})
    assert time.perf_counter() - started < 0.02
    injector.close()
    assert collective_timing._LATE_STARTS == []
    with pytest.raises(ValueError, match="unknown option"):
        faults.parse_slowdowns("slow_compute:rank=1:speed=2")
    assert faults.parse("slow_compute:rank=1;kill@forward,rank=0") == [faults.Fault("kill", "forward", None, 0)]


def test_collectives_are_replaced_only_when_the_config_asks_for_rank_health(monkeypatch, process_group_of_one):
    """Default config: torch.distributed's and DeepSpeed's collectives are the originals and no monitor joins
    the step. `train.rank_health` (or `train.adaptive_batch`) on several ranks wraps both."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from mmpt.engine import deepspeed_private
    from mmpt.engine.run import start_process_group

    start_process_group(watchdog_timeout=0)
    backend = deepspeed_private.comm_backend()
    monkeypatch.setattr(health.mdist, "get_world_size", lambda group=None: 2)  # as on two ranks
    monkeypatch.setattr(health.mdist, "all_gather_objects", lambda value: [value, value])

    def replaced() -> list[str]:
        names = ("all_reduce", "all_gather_into_tensor")
        return [f"torch.distributed.{n}" for n in names if getattr(dist, n) is not getattr(distributed_c10d, n)] + [
            f"cdb.{n}"
            for n in names
            if n in vars(backend)  # DeepSpeed's own are its class's methods
        ]

    default = TrainConfig(max_steps=1, grad_clip=0)
    assert HealthMonitor.start(default, Path("unused"), cuda=False) is None
    assert replaced() == []
    for asked in ({"rank_health": True}, {"adaptive_batch": True}):
        try:
            assert HealthMonitor.start(default.model_copy(update=asked), Path("unused"), cuda=False) is not None
            assert len(replaced()) == 4, (asked, replaced())
        finally:
            collective_timing.uninstall()
        assert replaced() == []


# -- 2-rank runs ------------------------------------------------------------------------------------------
# In the shared pool of ranks: each run carries out its slowdown (tests/faults.py) on rank 1; the lines a run logs
# are in its record's warnings, how it ended in its record's stops.

HEALTH = dict(zero_stage=2, max_steps=7, save_every=0, log_every=1, rank_health=True)
FAULTS = {"straggler": "slow_compute:rank=1:factor=2", "slow collectives": "slow_collectives:rank=1:delay=0.05"}


def health_scenario(name: str, fault: str | None, **train) -> str:
    @scenario(name, fault=fault)
    def build(corpora, run_dir):
        return tiny_config(corpora["digits"], run_dir, train={**HEALTH, **train}), [], "train"

    return name


NAMED = {kind: health_scenario(f"health-{kind.replace(' ', '-')}", fault) for kind, fault in FAULTS.items()}
CLEAN = health_scenario("health-clean", None)
STOPPED = health_scenario("health-stop", FAULTS["slow collectives"], on_unhealthy="stop")


def named(lines: list[str]) -> list[str]:
    return [line for line in lines if "straggler: rank" in line or "slow collectives: rank" in line]


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.pool(name)) for kind, name in NAMED.items()])
def test_each_fault_is_told_apart_and_named_within_three_windows(rank_pool, kind):
    record = rank_pool.record(NAMED[kind])
    assert record["stops"] == [None, None]
    report = json.loads((rank_pool.run_dir(NAMED[kind]) / "unhealthy.json").read_text())
    assert [(r["kind"], r["rank"]) for r in report["ranks"]] == [(kind, 1)], named(record["said"])
    assert report["step"] <= 4  # the first window holds start-up; named by the third after it
    other = "slow collectives" if kind == "straggler" else "straggler"
    lines = named(record["said"])
    assert lines and all(f"{kind}: rank 1" in line and f"{other}: rank" not in line for line in lines), lines
    summary = json.loads((rank_pool.run_dir(NAMED[kind]) / "summary.json").read_text())  # the run's summary too
    expected = {"stragglers": [], "slow_collectives": []}
    expected["stragglers" if kind == "straggler" else "slow_collectives"] = ["1"]
    assert {key: list(summary[key]) for key in expected} == expected, summary


@pytest.mark.pool(CLEAN)
def test_a_clean_run_names_nobody(rank_pool):
    run_dir = rank_pool.run_dir(CLEAN)
    assert named(rank_pool.record(CLEAN)["said"]) == [] and not (run_dir / "unhealthy.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stragglers"] == {} and summary["slow_collectives"] == {}


@pytest.mark.pool(STOPPED)
def test_stop_on_an_unhealthy_rank_exits_with_its_code_and_the_rest_resume(rank_pool, process_group_of_one, caplog):
    from mmpt.config_loader import load_config

    run_dir, stopped = rank_pool.run_dir(STOPPED), rank_pool.record(STOPPED)["stops"]
    assert [code for _, code in stopped] == [stops.EXIT_UNHEALTHY] * 2, stopped
    assert stopped[0][0].startswith("unhealthy rank: slow collectives: rank 1 on node "), stopped
    assert stopped[1][0] == "rank 1: stopped on the unhealthy rank that rank 0 reports", stopped
    report = json.loads((run_dir / "unhealthy.json").read_text())
    assert report["action"] == "stop"
    # The scheduler restarts without the unhealthy rank's node: here, on the one rank left (this process).
    with caplog.at_level("WARNING", logger="mmpt"):
        train_in_process(load_config(run_dir / "config.yaml"))
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert resumed and "saved by 2 ranks" in resumed[0], resumed
    assert f"at step {report['step']}," in resumed[0], resumed  # from the step it stopped at: none lost
    steps = [r["step"] for r in read_metrics(run_dir) if "loss/total" in r]
    assert steps and steps[-1] == 7, steps


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault, kind",
    # Factor 4: four ranks on two cores run each rank's work up to 2x slower while it shares a core, and the
    # late rank often computes alone after its peers have reached the collective, so a 2x slowdown can look
    # like its peers' contended pace.
    [("slow_compute:rank=3:factor=4", "straggler"), ("slow_collectives:rank=3:delay=0.05", "slow collectives")],
)
def test_two_nodes_the_faulty_rank_and_its_node_are_named(tmp_path, digits_root, fault, kind):
    """2 nodes x 2 ranks on this machine (each node its own torchrun, as tests/test_multinode.py starts them)."""
    from test_multinode import STALE_LAUNCHER_VARIABLES, node_commands, run_nodes

    settings = dict(zero_stage=2, max_steps=6, save_every=0, log_every=1, rank_health=True)
    config = write_config(
        tmp_path / "cfg.yaml",
        tiny_config(digits_root, tmp_path / "run", train=settings, data={"train": {"batch_size": 8}}),
    )
    env = {k: v for k, v in launcher_env().items() if k not in STALE_LAUNCHER_VARIABLES}
    env.update(faults.environment(fault))
    script = [str(REPO / "launch/train.py"), "--config", str(config), *faults.ARGS]
    commands = node_commands("torchrun", 2, 2, tmp_path, script)
    outputs = run_nodes(commands, env, tmp_path / "logs", timeout=600)
    report = json.loads((tmp_path / "run/unhealthy.json").read_text())
    assert [(r["kind"], r["rank"], r["node_rank"]) for r in report["ranks"]] == [(kind, 3, 1)], named("".join(outputs))
    assert report["step"] <= 5  # four processes on two cores: start-up can fill the first two windows
