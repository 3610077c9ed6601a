"""The GPU benchmark suite (benchmarks/gpu) end to end on CPU: its dry run, every stage with tiny shapes.

The GPU figures themselves only come from a GPU machine; this keeps the suite runnable until then.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import report
import stages
from stages import STAGES, search_batch
from training import benchmark_settings, deep_update

SECTION_HEADERS = {
    "clip_vitb16": "| trainer | ZeRO | status | samples/s |",
    "m2_encoder": "| ZeRO | grad_accum | micro-batch | samples/s |",
    "loss_memory": "| loss | largest b that fits | first OOM | stopped by |",
    "victor": "| batch | samples/s | step s |",
    "space2": "| batch | samples/s | step s |",
    "nccl": "| collective | result | seconds |",
}


@pytest.fixture(scope="module")
def dry_run(module_tmp):
    out, work = module_tmp("gpu-out"), module_tmp("gpu-work")
    results = REPO / "benchmarks" / "results"
    before = sorted(p.name for p in results.iterdir())
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/gpu/suite.py"),
            "--dry-run",
            "--output-dir",
            str(out),
            "--work",
            str(work),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log_tails(work)
    assert sorted(p.name for p in results.iterdir()) == before, "a dry run must not write benchmarks/results/"
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


def log_tails(work) -> str:
    logs = sorted((work / "logs").glob("stage-*.log"))
    return "".join(f"\n--- {log.name}\n" + log.read_text()[-3000:] for log in logs)


def test_dry_run_runs_every_stage(dry_run):
    record, _ = dry_run
    assert record["dry_run"] is True
    assert list(record["stages"]) == list(STAGES)
    for name, stage in record["stages"].items():
        assert stage["status"] == "ok", (name, stage["error"])
        assert stage["results"]["errors"] == []


def test_dry_run_records_every_figure(dry_run):
    stages = {name: stage["results"] for name, stage in dry_run[0]["stages"].items()}
    clip = stages["clip_vitb16"]
    assert clip["flops_per_step"] > 0 and clip["matmul"]["tflops"] > 0
    assert [r["name"] for r in clip["runs"]] == ["mmpt ZeRO-0", "mmpt ZeRO-2", "open_clip_train"]
    for run in clip["runs"]:
        assert run["samples_per_s"] > 0 and run["step_s"] > 0 and run["data_s"] >= 0
        assert run["mfu_measured_peak"] > 0 and "peak_allocated_mib" in run
    assert all(r["backward_optimizer_s"] is not None for r in clip["runs"][:2])  # mmpt logs its forward time
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


def test_dry_run_report_has_a_table_per_stage(dry_run):
    record, text = dry_run
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


def test_a_failed_stage_is_reported_with_its_error():
    record = {
        "environment": {"date": "d", "gpu": None, "cpu_count": 2, "versions": {}},
        "dry_run": False,
        "stages": {
            "nccl": {"status": "failed", "error": "RuntimeError: boom", "results": None},
            "victor": {"status": "skipped", "error": "suite budget spent (540 s)", "results": None},
        },
    }
    text = report.markdown(record)
    assert "| nccl | failed |" in text and "**failed**: RuntimeError: boom" in text
    assert "**skipped**: suite budget spent" in text
