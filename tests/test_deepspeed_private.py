"""DeepSpeed's private API is used only through mmpt/engine/deepspeed_private.py, for the release pyproject.toml
pins: a run on another release stops at its start with one line naming both versions."""

import deepspeed
import pytest

from conftest import REPO, tiny_config, write_config
from mmpt.config_loader import load_config
from mmpt.engine import deepspeed_private, stops
from mmpt.engine import run as runs


def test_the_pinned_release_is_the_one_the_private_api_was_written_for():
    assert f'"deepspeed=={deepspeed_private.EXPECTED}"' in (REPO / "pyproject.toml").read_text()
    deepspeed_private.check_version()  # the installed one


def test_another_deepspeed_release_stops_the_run_at_its_start_in_one_line(tmp_path, digits_root, monkeypatch):
    cfg = load_config(write_config(tmp_path / "cfg.yaml", tiny_config(digits_root, tmp_path / "run")))
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(Exception) as caught:
        runs.start(cfg)
    end = stops.ending(caught.value, rank=0)
    assert end is not None and end.exit_code == stops.EXIT_CONFIG
    assert end.line == (
        f"config error: mmpt needs DeepSpeed {deepspeed_private.EXPECTED} (it uses that release's private API), "
        f"but DeepSpeed 0.20.1 is installed: pip install deepspeed=={deepspeed_private.EXPECTED}"
    )
    assert not (tmp_path / "run").exists()  # stopped before anything was written
    other = stops.ending(caught.value, rank=1)  # leaves the saying to rank 0, and gives it time to say it
    assert other is not None and other.line == "rank 1: stopped on the config error that rank 0 reports"
    assert other.exit_code == stops.EXIT_CONFIG and other.linger_s > 0
