"""`run.wandb`: the same scalars as TensorBoard, evaluations and the resolved config go to Weights & Biases;
a resumed run continues its W&B run; offline mode needs no network."""

import json
import subprocess
import sys

from conftest import REPO, launcher_env, tiny_config, write_config

FAKE_WANDB = '''
"""Stands in for the wandb package: records what mmpt sends it, as json lines in $FAKE_WANDB_LOG."""
import json, os

def _record(**entry):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as handle:
        handle.write(json.dumps(entry) + "\\n")

class _Summary(dict):
    def update(self, values):
        _record(summary=values)

class _Run:
    summary = _Summary()
    def log(self, data, step=None):
        _record(log=data, step=step)
    def finish(self):
        _record(finish=True)

def init(**settings):
    _record(init=settings)
    return _Run()
'''


def train(config, env, *overrides):
    result = subprocess.run(
        [sys.executable, str(REPO / "launch/train.py"), "--config", str(config), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_scalars_evaluations_and_config_reach_wandb_and_a_resumed_run_continues_it(tmp_path, digits_root):
    (tmp_path / "fake/wandb").mkdir(parents=True)
    (tmp_path / "fake/wandb/__init__.py").write_text(FAKE_WANDB)
    log = tmp_path / "wandb_log.jsonl"
    env = {**launcher_env(), "PYTHONPATH": str(tmp_path / "fake"), "FAKE_WANDB_LOG": str(log)}
    cfg = tiny_config(digits_root, tmp_path / "run", train={"max_steps": 4, "save_every": 2, "eval_every": 2})
    cfg["run"]["wandb"] = {"project": "mmpt-tests", "mode": "offline", "tags": ["ci"]}
    cfg["data"]["eval"] = [{"dataset": str(digits_root / "zeroshot"), "task": "zeroshot_classification"}]
    config = write_config(tmp_path / "cfg.yaml", cfg)
    train(config, env, "train.max_steps=2")
    train(config, env)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [e["init"] for e in entries if "init" in e]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == "allow"
    assert inits[0]["project"] == "mmpt-tests" and inits[0]["name"] == "run" and inits[0]["mode"] == "offline"
    assert inits[0]["config"]["train"]["eval_every"] == 2 and inits[0]["tags"] == ["ci"]
    logged = [(e["step"], e["log"]) for e in entries if "log" in e]
    assert [step for step, data in logged if "loss/total" in data] == [1, 2, 3, 4]
    assert all(
        "samples_per_s" in data and "step_time_per_rank/rank0" in data for _, data in logged if "loss/total" in data
    )
    # Each run's end: the first stopped at step 2, the resumed one at 4 (each end also sets the run's summary).
    evaluated = [(step, data["eval/zeroshot/en/acc1"]) for step, data in logged if "eval/zeroshot/en/acc1" in data]
    assert [step for step, _ in evaluated] == [2, 4]
    assert [e["summary"]["eval/zeroshot/en/acc1"] for e in entries if "summary" in e] == [acc for _, acc in evaluated]
    assert sum("finish" in e for e in entries) == 2


def test_offline_wandb_runs_with_no_network(tmp_path, digits_root):
    cfg = tiny_config(digits_root, tmp_path / "run", train={"max_steps": 2, "save_every": 0})
    cfg["run"]["wandb"] = {"project": "mmpt-tests", "mode": "offline"}
    env = {**launcher_env(), "WANDB_SILENT": "true", "HTTPS_PROXY": "http://127.0.0.1:9", "WANDB_DIR": str(tmp_path)}
    train(write_config(tmp_path / "cfg.yaml", cfg), env)
    run_id = (tmp_path / "run/wandb_run_id").read_text().strip()
    assert list((tmp_path / "run/wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
