"""The GPU benchmark suite (benchmarks/gpu) on CPU: its dry run (every stage with tiny shapes), what a command keeps
when a stage hangs or the command is killed, and how the figures are read from the trainers' logs.

The GPU figures themselves only come from a GPU machine; this keeps the suite runnable until then. Minutes of
training runs: outside the default run.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import report
import stages
import suite

pytestmark = pytest.mark.extended


def suite_command(out, work, *options):
    script = str(REPO / "benchmarks/gpu/suite.py")
    return [sys.executable, script, "--dry-run", "--output-dir", str(out), "--work", str(work), *options]


def suite_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, **extra}


def statuses(out) -> dict[str, str]:
    return {name: record["status"] for name, record in suite.read_stages(out).items()}


def log_tails(work) -> str:
    logs = sorted((work / "logs").glob("*.log"))
    return "".join(f"\n--- {log.name}\n" + log.read_text()[-2000:] for log in logs)


@pytest.fixture(scope="module")
def dry_run(module_tmp):
    out, work = module_tmp("gpu-out"), module_tmp("gpu-work")
    results_folder = REPO / "benchmarks" / "results"
    before = sorted(str(p.relative_to(results_folder)) for p in results_folder.rglob("*"))
    done = subprocess.run(
        suite_command(out, work), cwd=REPO, env=suite_env(), capture_output=True, text=True, timeout=2400
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log_tails(work)
    after = sorted(str(p.relative_to(results_folder)) for p in results_folder.rglob("*"))
    assert after == before, "a dry run must not write benchmarks/results/"
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), out


def test_dry_run_runs_every_stage_and_records_its_figures(dry_run):
    record, text, out = dry_run
    assert record["dry_run"] is True and list(record["stages"]) == list(suite.CAPS)
    for name, stage in record["stages"].items():
        assert stage["status"] == "ok", (name, stage["error"])
        assert f"(`{name}`)" in text, name
        for run in stage["results"].get("runs", []):
            assert run["steps_logged"] == stages.DRY.steps and run["samples_per_s"] > 0, run
    clip = {run["name"]: run for run in record["stages"]["clip_vitb16"]["results"]["runs"]}
    assert set(clip) == {"mmpt ZeRO-0", "mmpt ZeRO-2", "open_clip_train"}
    assert all(v["largest_fit"] for v in record["stages"]["loss_memory"]["results"]["variants"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu.json", "gpu.md", "logs.tar.gz", *(f"stage-{n}.json" for n in suite.CAPS)]
    )


def test_a_stage_past_its_cap_is_timed_out_and_the_next_stage_runs(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(
        suite_command(out, work, "--only", "space2,loss_memory", "--cap", "15"),
        cwd=REPO,
        env=suite_env(**{suite.STALL_VARIABLE: "space2"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert statuses(out) == {"space2": "timed_out", "loss_memory": "ok"}, log_tails(work)
    assert "| space2 | timed_out |" in (out / "gpu.md").read_text()


def test_a_command_killed_mid_stage_keeps_the_finished_stages(tmp_path):
    """Killed from outside while a stage runs (the limit of a remote call): the stages before it keep their
    records and the report lists them, the running stage shows as running."""
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.Popen(
        suite_command(out, work, "--only", "loss_memory,space2"),
        cwd=REPO,
        env=suite_env(**{suite.STALL_VARIABLE: "space2"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while statuses(out).get("space2") != "running" and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert statuses(out) == {"loss_memory": "ok", "space2": "running"}, log_tails(work)
    text = (out / "gpu.md").read_text()
    assert "| loss | largest b that fits |" in text and "| space2 | running |" in text
    assert (out / "logs.tar.gz").is_file()


def test_every_command_of_the_plan_fits_a_remote_call():
    planned = [name for names in suite.COMMANDS.values() for name in names]
    assert sorted(planned) == sorted(suite.CAPS) == sorted(stages.STAGES), "each stage in one command"
    for names in suite.COMMANDS.values():
        assert sum(suite.CAPS[n] for n in names) + suite.SETUP_S + suite.END_MARGIN_S <= suite.COMMAND_S, names
    assert all(f"run.sh --group {group}" in suite.describe() for group in suite.COMMANDS)


def test_a_run_stopped_at_its_share_keeps_the_steps_it_logged(tmp_path):
    def line(step, seconds):
        per_rank = {"step_time_per_rank": [seconds], "data_time_per_rank": [0.1], "forward_time_per_rank": [0.2]}
        extra = {"gpu_peak_allocated_gib_per_rank": [3.0, 4.0], "perf/tflops": 100.0 + step, "perf/mfu": 0.25}
        return json.dumps({"step": step, **per_rank, **extra})

    path = tmp_path / "metrics.jsonl"
    lines = [line(s, 1.0 + s) for s in range(1, 5)]
    path.write_text("\n".join([*lines, lines[0][:20]]))  # killed while writing its last line
    steps = stages.mmpt_steps(path)
    assert len(steps) == 4
    run = stages.finish_run({"name": "r", "status": "timeout", "global_batch": 8}, steps, stages.DRY)
    assert run["partial"] and run["steps_timed"] == 3 and run["step_s"] == 4.0 and run["samples_per_s"] == 2.0
    assert run["tflops"] == 103.0 and run["mfu"] == 0.25 and run["peak_gib"] == 4.0
    assert "| r | timeout (partial) | 8 | 2.0 | 4.000 |" in report.markdown(
        {"environment": {}, "stages": {"victor": {"status": "timed_out", "results": {"runs": [run]}}}}
    )
    none = stages.finish_run({"name": "r", "status": "ok", "global_batch": 8}, [], stages.DRY)
    assert none["status"] == "error" and none["error"] == "no step was logged"


def test_the_batch_search_doubles_until_out_of_memory():
    found = stages.search_batch(lambda b: {"status": "ok" if b <= 32 else "oom", "wall_s": 0.0}, 8, 1024, 1e12)
    assert (found["largest_fit"], found["first_oom"], found["stopped_by"]) == (32, 64, "oom")
    assert [t["batch"] for t in found["trials"]] == [8, 16, 32, 64]
    capped = stages.search_batch(lambda b: {"status": "ok", "wall_s": 0.0}, 8, 16, 1e12)
    assert (capped["largest_fit"], capped["stopped_by"]) == (16, "cap")


def test_merge_joins_the_folders_of_several_commands(tmp_path):
    def record(status, gpu="NVIDIA H100 80GB HBM3"):
        environment = {"date": "d", "gpu": {"name": gpu, "memory_total": "80 GiB", "driver": "1"}, "versions": {}}
        return {"status": status, "error": None, "results": None, "environment": environment}

    first, second, merged = tmp_path / "1", tmp_path / "2", tmp_path / "merged"
    suite.record_stage([first], "victor", record("timed_out"))
    suite.record_stage([second], "clip_vitb16", record("ok"))
    (second / "logs.tar.gz").write_bytes(b"the second command's logs")
    found = suite.merge([first, second], merged)
    assert list(found["stages"]) == ["clip_vitb16", "victor"]  # the suite's order
    assert (merged / "logs-2.tar.gz").read_bytes() == b"the second command's logs"
    suite.record_stage([second], "space2", record("ok", gpu="NVIDIA H200"))
    with pytest.raises(SystemExit, match="different machines"):
        suite.merge([first, second], tmp_path / "again")
