"""The GPU benchmark suite (benchmarks/gpu) end to end on CPU: its dry run, every stage with tiny shapes, and what
a command keeps when a stage hangs or the command is killed.

The GPU figures themselves only come from a GPU machine; this keeps the suite runnable until then.
"""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
import zipfile

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import plan
import prepare_wheels
import report
import results
import stages
import suite
from probe import SYNC_MESSAGE, SyncWarnings
from stages import PROFILED_STEPS, STAGES, search_batch
from training import benchmark_settings, deep_update

SECTION_HEADERS = {
    "clip_vitb16": "| trainer | ZeRO | status | samples/s |",
    "m2_encoder": "| ZeRO | grad_accum | micro-batch | samples/s |",
    "loss_memory": "| loss | largest b that fits | first OOM | stopped by |",
    "victor": "| batch | samples/s | step s |",
    "space2": "| batch | samples/s | step s |",
    "nccl": "| collective | result | seconds |",
    "clip_compile": "| mode | samples/s | step s | first step s |",
    "clip_profile": "| run | status | wall s/step | device busy s/step |",
    "data_loader": "| workers | samples/s | per worker |",
}


def suite_command(out, work, *options):
    return [
        sys.executable,
        str(REPO / "benchmarks/gpu/suite.py"),
        "--dry-run",
        "--output-dir",
        str(out),
        "--work",
        str(work),
        *options,
    ]


def suite_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, **extra}


def statuses(out) -> dict[str, str]:
    return {name: record["status"] for name, record in results.read_stages(out).items()}


def report_rows(out) -> dict[str, str]:
    """{stage: status} as gpu.md's table of stages shows them now."""
    path = out / "gpu.md"
    rows = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in STAGES:
            rows[cells[0]] = cells[1]
    return rows


@pytest.fixture(scope="module")
def dry_run(module_tmp):
    """The whole dry run, its output folder watched while it runs: a snapshot each time a stage file changes."""
    out, work = module_tmp("gpu-out"), module_tmp("gpu-work")
    results_folder = REPO / "benchmarks" / "results"
    before = sorted(str(p.relative_to(results_folder)) for p in results_folder.rglob("*"))
    process = subprocess.Popen(
        suite_command(out, work), cwd=REPO, env=suite_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    snapshots, deadline = [], time.monotonic() + 1500
    while process.poll() is None and time.monotonic() < deadline:
        now = statuses(out)
        if not snapshots or now != snapshots[-1][0]:
            snapshots.append((now, report_rows(out)))
        time.sleep(0.1)
    if process.poll() is None:
        process.kill()
    output = process.communicate()[0]
    not_ok = {n: (r["status"], r["error"]) for n, r in results.read_stages(out).items() if r["status"] != "ok"}
    assert process.returncode == 0, f"{not_ok}\n" + output[-3000:] + log_tails(work)
    after = sorted(str(p.relative_to(results_folder)) for p in results_folder.rglob("*"))
    assert after == before, "a dry run must not write benchmarks/results/"
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), snapshots, out


def log_tails(work) -> str:
    logs = sorted((work / "logs").glob("stage-*.log"))
    return "".join(f"\n--- {log.name}\n" + log.read_text()[-3000:] for log in logs)


def test_each_stage_file_and_the_report_are_written_as_the_stage_ends(dry_run):
    *_, snapshots, out = dry_run
    names = list(STAGES)
    for index, name in enumerate(names[:-1]):
        # a moment when this stage's record was final, in the report too, and a later stage had not finished
        assert any(
            seen.get(name) == "ok"
            and rows.get(name) == "ok"
            and any(seen.get(later) in (None, "running") for later in names[index + 1 :])
            for seen, rows in snapshots
        ), (name, snapshots)
    # a stage's record exists while it runs (short stages may start and end between two looks)
    assert any(status == "running" for seen, _ in snapshots for status in seen.values()), snapshots
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu.json", "gpu.md", "logs.tar.gz", *(f"stage-{n}.json" for n in names)]
    )


def test_dry_run_runs_every_stage(dry_run):
    record, *_ = dry_run
    assert record["dry_run"] is True
    assert list(record["stages"]) == list(STAGES)
    for name, stage in record["stages"].items():
        assert stage["status"] == "ok", (name, stage["error"])
        assert stage["results"]["errors"] == []


def test_dry_run_records_every_figure(dry_run):
    stages = {name: stage["results"] for name, stage in dry_run[0]["stages"].items()}
    clip = stages["clip_vitb16"]
    assert all(r["sync_debug"] == "off: no CUDA device" and r["sync_warnings"] == 0 for r in clip["runs"])
    assert clip["flops_per_step"] > 0 and clip["matmul"]["tflops"] > 0
    assert [r["name"] for r in clip["runs"]] == ["mmpt ZeRO-0", "mmpt ZeRO-2", "open_clip_train"]
    for run in clip["runs"]:
        assert run["samples_per_s"] > 0 and run["step_s"] > 0 and run["data_s"] >= 0
        assert run["mfu_measured_peak"] > 0 and "peak_allocated_mib" in run
    assert all(r["backward_optimizer_s"] is not None for r in clip["runs"][:2])  # mmpt logs its forward time
    profiled = stages["clip_profile"]
    assert [r["name"] for r in profiled["runs"]] == ["profile ZeRO-0", "profile ZeRO-2"]
    for run in profiled["runs"]:
        summary = run["profile"]
        assert summary["steps"] == PROFILED_STEPS and summary["wall_s_per_step"] > 0
        assert summary["top_ops"] and all(op["ms_per_step"] > 0 for op in summary["top_ops"]), summary
        assert any(op["name"] == "aten::mm" for op in summary["top_ops"])  # the towers' matmuls, on CPU too
        assert any(dry_run[3].parent.glob(f"gpu-work*/logs/{summary['trace']}")), summary["trace"]  # the trace kept
    m2 = stages["m2_encoder"]["settings"]
    assert [(s["zero_stage"], s["grad_accum"]) for s in m2] == [(2, 1), (2, 4), (3, 1), (3, 4)]
    for setting in m2:
        assert setting["throughput"]["samples_per_s"] > 0
        assert setting["largest_fit"] >= setting["throughput"]["batch"] and setting["stopped_by"] == "cap"
    losses = stages["loss_memory"]["variants"]
    assert [v["variant"] for v in losses] == ["clip", "gba G=N", "gba G=N tiled"]
    assert all(v["largest_fit"] and all("peak_mib" in t for t in v["trials"]) for v in losses)
    for method in ("victor", "space2"):
        assert stages[method]["run"]["samples_per_s"] > 0
    nccl = stages["nccl"]
    assert set(nccl["collectives"].values()) <= {"ok", "skipped: NCCL only"}
    assert "multi-rank NCCL needs a multi-GPU machine" in nccl["note"]
    compiled = stages["clip_compile"]
    assert list(compiled["modes"]) == ["eager", "compiled"] and compiled["speedup"] > 0
    for mode in compiled["modes"].values():
        assert mode["samples_per_s"] > 0 and mode["steps_run"] == stages_profile().warmup + stages_profile().steps
    loader = stages["data_loader"]
    assert [r["workers"] for r in loader["runs"]] == sorted({1, 2, os.cpu_count() or 1})
    for run in loader["runs"]:
        assert run["samples_per_s"] > 0 and run["image_dtype"] == "torch.uint8", run


def stages_profile():
    return stages.DRY


def test_dry_run_report_has_a_table_per_stage(dry_run):
    record, text, *_ = dry_run
    assert text.startswith("# GPU benchmarks") and "**Dry run**" in text
    assert f"torch {record['environment']['versions']['torch']}" in text
    for name, header in SECTION_HEADERS.items():
        section = text.split(f"(`{name}`)", 1)[1]
        assert header in section.split("\n## ", 1)[0], name


@pytest.mark.parametrize("profile", [stages.GPU, stages.DRY], ids=["gpu", "dry"])
def test_every_config_the_suite_trains_is_valid(profile, tmp_path):
    """The GPU profile's configs (0.4B, base sizes, batch-size trials) are only trained on a GPU: validate them here."""
    import yaml

    from mmpt.config_loader import load_config

    for name, config in stages.training_configs(profile, tmp_path / "data").items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(deep_update(config, benchmark_settings(tmp_path / "run", profile.steps))))
        cfg = load_config(path)
        assert cfg.train.precision == "bf16" and cfg.train.save_every == 0, name


def test_busy_time_counts_overlapping_kernels_once():
    from probe import busy_us

    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # two streams overlapping, then a gap
    assert busy_us([]) == 0


def test_peak_by_phase_folds_every_phase_into_the_run_peak(monkeypatch):
    """The probe resets the allocator's peak at each step point: the run's peak is the highest phase's."""
    import torch
    from probe import PeakByPhase

    peaks = iter([100, 700, 300, 50])  # setup, data, forward, backward (read at the end)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks) * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 800 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    phases = PeakByPhase()
    for point in ("data", "forward", "backward"):
        phases.reached(point, 1)
    record = phases.record({"peak_allocated_mib": 50.0, "peak_reserved_mib": 800.0})  # read after the last reset
    assert record["peak_allocated_mib_by_phase"] == {"setup": 100, "data": 700, "forward": 300, "backward": 50}
    assert record["peak_allocated_mib"] == 700 and record["peak_reserved_mib"] == 800
    assert report.peak(record) == "0.68 (data)"


def test_a_run_stopped_at_its_time_keeps_the_steps_it_logged(tmp_path, monkeypatch):
    """A run cut off by its share of the time still has its logged steps summarised, marked partial."""
    from training import Runner, mmpt_run

    run = mmpt_run("m2 ZeRO-3", tmp_path, {"train": {}}, 15, 1024)
    runner = Runner(tmp_path, isolate=True)

    def stopped(run, timeout):  # the trainer wrote 6 steps before it was killed
        run.log_dir.mkdir(parents=True)
        lines = [{"step_time_per_rank": [2.0], "data_time_per_rank": [0.0], "forward_time_per_rank": [0.5]}] * 6
        (run.log_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return {"status": "timeout", "wall_s": timeout, "error": "stopped"}

    monkeypatch.setattr(runner, "_in_own_process", stopped)
    record = runner.run(run, 60.0, warmup=5)
    assert record["status"] == "timeout" and record["partial"] is True
    assert (record["steps_logged"], record["steps_timed"], record["samples_per_s"]) == (6, 1, 512.0)
    few = runner.run(run, 60.0, warmup=6)  # no step after the warm-up: nothing to report
    assert "partial" not in few and "samples_per_s" not in few


def test_batch_search_doubles_until_out_of_memory_and_halves_from_a_batch_that_does_not_fit():
    def fits_up_to(limit):
        return lambda batch: {"status": "ok" if batch <= limit else "oom", "wall_s": 1.0}

    up = search_batch(fits_up_to(300), 64, 4096, deadline=float("inf"))
    assert [t["batch"] for t in up["trials"]] == [64, 128, 256, 512]
    assert (up["largest_fit"], up["first_oom"], up["stopped_by"]) == (256, 512, "oom")
    down = search_batch(fits_up_to(300), 1024, 1024, deadline=float("inf"))
    assert [t["batch"] for t in down["trials"]] == [1024, 512, 256]
    assert (down["largest_fit"], down["first_oom"], down["stopped_by"]) == (256, 512, "oom")
    known = search_batch(fits_up_to(300), 512, 4096, deadline=float("inf"), known_fit=256)
    assert [t["batch"] for t in known["trials"]] == [512] and known["largest_fit"] == 256
    capped = search_batch(fits_up_to(10**6), 64, 256, deadline=float("inf"))
    assert (capped["largest_fit"], capped["stopped_by"]) == (256, "cap")
    timed = search_batch(fits_up_to(10**6), 64, 4096, deadline=10.0, growth=4.0, clock=lambda: 7.0)
    assert (timed["largest_fit"], timed["stopped_by"], len(timed["trials"])) == (64, "time", 1)


# ----------------------------------------------------------------------------- a stage that hangs, a killed command


def test_a_stage_past_its_cap_is_recorded_as_timed_out_and_the_next_stage_runs(tmp_path):
    """The alarm at the cap stops a stage hanging in Python; the suite records it and goes on."""
    out = tmp_path / "out"
    done = subprocess.run(
        suite_command(out, tmp_path / "work", "--only", "nccl,loss_memory", "--cap", "nccl=10"),
        cwd=REPO,
        env=suite_env(**{suite.STALL_VARIABLE: "nccl"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert statuses(out) == {"nccl": "timed_out", "loss_memory": "ok"}, log_tails(tmp_path / "work")
    assert report_rows(out) == {"nccl": "timed_out", "loss_memory": "ok"}
    assert "**timed_out**: stopped at its cap (10 s)" in (out / "gpu.md").read_text()


def test_a_stage_deaf_to_the_alarm_is_killed_and_the_next_stage_runs(tmp_path):
    """A hang the alarm cannot stop (inside CUDA, say): its process is killed after the grace; the next stage runs."""
    out = tmp_path / "out"
    done = subprocess.run(
        suite_command(out, tmp_path / "work", "--only", "nccl,loss_memory", "--cap", "nccl=6", "--isolate"),
        cwd=REPO,
        env=suite_env(**{suite.STALL_VARIABLE: "nccl:hard"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert statuses(out) == {"nccl": "timed_out", "loss_memory": "ok"}, log_tails(tmp_path / "work")
    nccl = results.read_stages(out)["nccl"]
    assert "did not stop at the alarm" in nccl["error"] and nccl["seconds"] == 12


def test_a_command_killed_mid_stage_keeps_the_finished_stages(tmp_path):
    """Killed from outside while a stage runs (the 10-minute limit of a remote call): the stages before it keep
    their records and the report lists them, the running stage shows as running."""
    out, work = tmp_path / "out", tmp_path / "work"
    process = subprocess.Popen(
        suite_command(out, work, "--only", "loss_memory,nccl"),
        cwd=REPO,
        env=suite_env(**{suite.STALL_VARIABLE: "nccl"}),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while statuses(out).get("nccl") != "running" and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    assert statuses(out).get("nccl") == "running", (process.poll(), log_tails(work))
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert statuses(out) == {"loss_memory": "ok", "nccl": "running"}, log_tails(work)
    assert report_rows(out) == {"loss_memory": "ok", "nccl": "running"}
    text = (out / "gpu.md").read_text()
    assert "| loss | largest b that fits |" in text and "the command ended while this stage ran" in text
    assert json.loads((out / "gpu.json").read_text())["stages"]["loss_memory"]["results"]["variants"]
    assert (out / "logs.tar.gz").is_file()


# ----------------------------------------------------------------------------- the plan, the records, the report


def test_every_command_of_the_plan_fits_a_remote_call():
    planned = [name for command in plan.COMMANDS for name in command.stages]
    assert planned == list(STAGES), "each stage in one command, in the order of STAGES"
    assert set(plan.CAPS) == set(STAGES)
    for command in plan.COMMANDS:
        assert command.seconds() <= plan.COMMAND_S, command
        assert command.files() <= plan.FILES_BACK, command
    text = plan.describe()
    assert all(f"bash benchmarks/gpu/run.sh --group {c.group}" in text for c in plan.COMMANDS)


def test_a_group_counts_its_budget_from_the_command_start(monkeypatch):
    args = suite.parse_args(["--group", "2"])
    assert args.only == ["loss_memory", "space2", "victor", "clip_compile"]
    monkeypatch.setenv(suite.COMMAND_START_VARIABLE, str(time.time() - 100))
    end = suite.budget_end(args, args.only, started=1000.0)
    assert end == pytest.approx(1000.0 + plan.COMMAND_S - 100 - plan.END_MARGIN_S, abs=2)
    # What is left of a lease: --budget counts from the suite's start and the earlier end wins.
    args = suite.parse_args(["--group", "2", "--budget", "120"])
    assert suite.budget_end(args, args.only, started=1000.0) == pytest.approx(1120.0)


def stage_record(name, status="ok", gpu="NVIDIA H100 80GB HBM3"):
    return {
        "status": status,
        "error": None,
        "results": None,
        "dry_run": False,
        "environment": {"date": "d", "gpu": {"name": gpu}, "cpu_count": 16, "versions": {}},
    }


def test_merge_joins_the_folders_of_several_commands(tmp_path):
    first, second, merged = tmp_path / "1", tmp_path / "2", tmp_path / "merged"
    results.record_stage([first], "nccl", stage_record("nccl"), list(STAGES))
    results.record_stage([second], "victor", stage_record("victor", "timed_out"), list(STAGES))
    (second / "logs.tar.gz").write_bytes(b"the second command's logs")
    record = suite.merge([first, second], merged, list(STAGES))
    assert list(record["stages"]) == [name for name in STAGES if name in ("nccl", "victor")]  # the suite's order
    assert report_rows(merged) == {"nccl": "ok", "victor": "timed_out"}
    assert sorted(p.name for p in merged.glob("logs-*")) == ["logs-2.tar.gz"]  # each command's logs, numbered
    assert (merged / "logs-2.tar.gz").read_bytes() == b"the second command's logs"
    results.record_stage([second], "space2", stage_record("space2", gpu="NVIDIA H200"), list(STAGES))
    with pytest.raises(SystemExit, match="different machines"):
        suite.merge([first, second], tmp_path / "again", list(STAGES))


def test_a_failed_stage_is_reported_with_its_error():
    record = {
        "environment": {"date": "d", "gpu": None, "cpu_count": 2, "versions": {}},
        "dry_run": False,
        "stages": {
            "nccl": {"status": "failed", "error": "RuntimeError: boom", "results": None},
            "victor": {"status": "skipped", "error": "suite budget spent (540 s)", "results": None},
            "space2": {"status": "running", "error": None, "results": None},
        },
    }
    text = report.markdown(record)
    assert "| nccl | failed |" in text and "**failed**: RuntimeError: boom" in text
    assert "**skipped**: suite budget spent" in text
    assert "**running**: did not finish: the command ended while this stage ran" in text


def test_sync_warnings_are_counted_by_point_and_site_and_others_pass_through():
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with SyncWarnings() as syncs:
            warnings.warn(f"{SYNC_MESSAGE} in setup", UserWarning, stacklevel=1)
            syncs.reached("forward", 1)
            for _ in range(2):
                warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    record = syncs.record()
    assert record["sync_warnings"] == 3 and record["sync_warnings_in_steps"] == 2
    assert record["sync_warnings_by_point"] == {"setup": 1, "forward": 2}
    assert sum(record["sync_warning_sites"].values()) == 3
    assert [str(w.message) for w in shown] == ["something else"]


# ----------------------------------------------------------------------------- the wheels against the GPU image


def fake_wheel(folder, name, requires=()):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    distribution = "-".join(name.split("-")[:2])
    with zipfile.ZipFile(path, "w") as archive:
        lines = ["Metadata-Version: 2.1", *(f"Requires-Dist: {r}" for r in requires)]
        archive.writestr(f"{distribution}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_wheels_the_image_cannot_install_are_named(tmp_path):
    good = [
        fake_wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl"),
        fake_wheel(tmp_path, "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"),
        fake_wheel(tmp_path, "av-18.1.0-cp39-abi3-manylinux_2_28_x86_64.whl"),
    ]
    assert prepare_wheels.tag_conflicts(good) == []
    cp311 = fake_wheel(tmp_path, "thing-1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    arm = fake_wheel(tmp_path, "other-1.0-py3-none-manylinux_2_17_aarch64.whl")
    found = prepare_wheels.tag_conflicts([*good, cp311, arm])
    assert len(found) == 2 and "thing-1.0-cp311" in found[0] and "aarch64" in found[1]


def test_requirements_the_image_does_not_meet_are_named():
    from packaging.requirements import Requirement

    pairs = [
        ("a", Requirement("torch>=2.0")),
        ("b", Requirement("torch==2.14.0")),
        ("c", Requirement("numpy<2")),
        ("d", Requirement("nvidia-cudnn-cu12")),
        ("e", Requirement("nvidia-cudnn-cu13")),
        ("f", Requirement("pydantic==2.14.4")),
    ]
    found = prepare_wheels.image_conflicts(pairs)
    assert found == [
        "b needs torch==2.14.0; the image has torch 2.11.0",
        "c needs numpy<2; the image has numpy 2.5.2",
        "d needs nvidia-cudnn-cu12, built for CUDA 12; the image has CUDA 13",
    ]


def test_the_check_fails_in_one_line_and_records_what_it_carries(tmp_path, capsys):
    folder = tmp_path / "whl"
    fake_wheel(folder, "hjson-3.1.0-py3-none-any.whl")
    fake_wheel(folder, "deepspeed-0.19.8-py3-none-any.whl", ["torch", "hjson"])
    assert prepare_wheels.check_folder(folder) == 0
    printed = capsys.readouterr().out
    assert "MiB + working tree" in printed and "MiB (transfer limit 64 MiB" in printed
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["carried"] == {"deepspeed": "0.19.8", "hjson": "3.1.0"}
    assert manifest["image"]["torch"] == "2.11.0" and manifest["image"]["python"] == "3.12"
    fake_wheel(folder, "pinned-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", ["torch==2.14.0"])
    assert prepare_wheels.check_folder(folder) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("prepare_wheels: cannot carry for the GPU image:")
    assert "built for cp311-cp311-manylinux_2_17_x86_64" in error and "torch==2.14.0" in error
