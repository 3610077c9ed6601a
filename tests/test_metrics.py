"""The metrics of a logging window: what a GPU run adds to each line (per-rank peak memory), read without
waiting for the device, and nothing of it on CPU ranks (every rank decides alike, from the training device)."""

import json

import pytest
import torch


def window(tmp_path, gpu):
    from mmpt.engine.metrics import MetricLogger

    logger = MetricLogger(
        tmp_path, max_steps=10, start_step=0, global_batch=8, tensorboard=False, progress_bar=False, gpu=gpu
    )
    logger.update({"contrastive": torch.tensor(2.5)})
    logger.update({"contrastive": torch.tensor(1.5)})
    record = logger.reduce(2, 0.1, {"data": 0.2, "forward": 0.4})
    logger.write(2, record)
    logger.close()
    return record, json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_gpu_window_logs_each_ranks_peak_memory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30 + 2**27)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("the window waited for the GPU"))
    record, written = window(tmp_path, gpu=True)
    assert record["loss/contrastive"] == pytest.approx(2.0)
    assert written["gpu_peak_allocated_gib_per_rank"] == [3.12] and written["gpu_peak_reserved_gib_per_rank"] == [4.0]
    assert written["data_time_per_rank"] == [0.1] and written["forward_time_per_rank"] == [0.2]
    assert capsys.readouterr().out.strip().endswith("gpu_peak=3.1GiB")  # the console line says it too


def test_a_cpu_window_logs_no_gpu_memory(tmp_path, monkeypatch):
    # Every rank alike, whatever the machine has: a CPU run on a GPU host gathers no memory either.
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: pytest.fail("read GPU memory"))
    record, written = window(tmp_path, gpu=False)
    assert not [key for key in written if key.startswith("gpu_")]
    assert written["data_time_per_rank"] == [0.1] and len(written["step_time_per_rank"]) == 1
