"""The shared pool of ranks: every 2-rank scenario of the selected tests trains in one launcher start.

A launcher start costs 30-75 s on 2 cores, more than most scenarios' training. So a test that needs a 2-rank
run registers it (`@scenario("name")` on a function building its config) and marks itself
`@pytest.mark.pool("name", ...)`; the session's first such test starts `tests/pool_runner.py` once, on
every scenario the selected tests name, and each test then asserts on its scenario's run folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, free_port, launcher_env, write_config

# name -> builder(corpora, run_dir) -> (config file or config dict, overrides, kind)
Builder = Callable[[dict, Path], tuple[Path | dict, list[str], str]]
SCENARIOS: dict[str, Builder] = {}
FIRST: set[str] = set()  # scenarios trained before any other in the pool's processes
FAULTS: dict[str, str] = {}  # scenario -> the faults its ranks carry out (tests/faults.py's syntax)
# Every scenario's run folder (checkpoints, releases) stays on disk to the session's end, for the tests to read:
# 4.0 GB for the default tier's 19 scenarios, 7.0 GB for the extended tier's 37 (0.19-0.21 GB each).
DISK_PER_SCENARIO = 0.3e9


def scenario(name: str, first: bool = False, fault: str | None = None) -> Callable[[Builder], Builder]:
    """Register a scenario. `first`: train it before the others, in processes no other run has touched, as a
    fresh launch would (a reference that another launch must equal bit for bit). `fault`: faults the ranks
    carry out in this run only (tests/faults.py: a NaN loss, a failed write; not a kill or a hang, which end
    the pool); a run they stop records each rank's one line and exit code, and the pool goes on. Such
    scenarios train after the others."""

    def register(build: Builder) -> Builder:
        assert name not in SCENARIOS, f"scenario {name} registered twice"
        SCENARIOS[name] = build
        if first:
            FIRST.add(name)
        if fault is not None:
            assert not fault.startswith(("kill", "sleep")), f"scenario {name}: a {fault} ends the pool"
            FAULTS[name] = fault
        return build

    return register


@dataclass
class RankPool:
    done: dict[str, dict]
    failure: str | None  # the scenario that ended the pool run, with its output

    def run_dir(self, name: str) -> Path:
        if name not in self.done:
            pytest.fail(f"pool scenario {name} did not finish: {self.failure}")
        return Path(self.done[name]["run_dir"])

    def record(self, name: str) -> dict:
        self.run_dir(name)
        return self.done[name]


def wanted(items) -> list[str]:
    names: list[str] = []
    for item in items:
        for marker in item.iter_markers("pool"):
            names += [n for n in marker.args if n not in names]
    return names


def build_scenarios(names: list[str], corpora: dict, root: Path) -> list[dict]:
    scenarios = []
    for name in sorted(names, key=lambda n: (n not in FIRST, n in FAULTS)):
        run_dir = root / name
        config, overrides, kind = SCENARIOS[name](corpora, run_dir)
        if isinstance(config, dict):
            config = write_config(root / f"{name}.yaml", config)
        scenarios.append(
            {
                "name": name,
                "config": str(config),
                "overrides": overrides,
                "kind": kind,
                "run_dir": str(run_dir),
                "fault": FAULTS.get(name),
            }
        )
    return scenarios


def run_pool(scenarios: list[dict], root: Path) -> RankPool:
    """Train `scenarios` (dicts: name, config, overrides, kind, run_dir) in one launcher start."""
    free, need = shutil.disk_usage(root).free, DISK_PER_SCENARIO * len(scenarios)
    if free < need:  # found now, not as a failed write half an hour in
        pytest.fail(
            f"{root}: {free / 1e9:.1f} GB free, and the shared pool's {len(scenarios)} scenarios keep about "
            f"{need / 1e9:.0f} GB of run folders to the session's end: free some, or give pytest another --basetemp",
            pytrace=False,
        )
    listed, results = root / "scenarios.json", root / "results.jsonl"
    listed.write_text(json.dumps(scenarios))
    command = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(REPO / "tests/pool_runner.py"),
        str(listed),
        str(results),
    ]
    result = subprocess.run(command, cwd=root, env=launcher_env(), capture_output=True, text=True, timeout=2400)
    done = {}
    if results.exists():
        done = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())}
    failure = None
    if result.returncode:
        started = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("pool scenario: ")]
        failure = f"{started[-1] if started else 'the start'} failed\n{result.stdout[-3000:]}{result.stderr[-5000:]}"
    for record in done.values():
        print(f"pool: {record['name']} in {record['seconds']} s")
    kept = sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
    print(f"pool: {len(done)} scenarios keep {kept / 1e9:.1f} GB on disk")
    return RankPool(done, failure)
