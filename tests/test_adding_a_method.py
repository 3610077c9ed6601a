"""docs/adding_a_method.md, followed as written: its toy method, defined outside mmpt and registered on
import, trains 2 steps on 2 ranks through the unchanged engine, its run loads back, and it exports to ONNX
through the unchanged exporter."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from conftest import REPO, free_port, launcher_env, read_metrics

GUIDE = REPO / "docs/adding_a_method.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guides_toy_method_trains_and_loads(tmp_path, monkeypatch, request):
    (tmp_path / "toy_method.py").write_text(blocks("python")[0])
    (tmp_path / "toy.yaml").write_text(blocks("yaml")[0])
    (tmp_path / "configs").symlink_to(REPO / "configs")  # the guide runs from the repository root
    command = blocks("bash")[0].split()
    assert command[:2] == ["PYTHONPATH=path/to/folder", "deepspeed"] and command[-4:] == [
        "--import",
        "toy_method",
        "--config",
        "toy.yaml",
    ]
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    env = dict(launcher_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [launcher, *command[2:4], "--master_port", str(free_port()), str(REPO / "launch/train.py"), *command[5:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs/toy"
    records = [r for r in read_metrics(run_dir) if "loss/contrastive" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["loss/contrastive"] < 10 for r in records)

    import mmpt
    from mmpt.methods import METHODS

    # "toy" is registered in this process only for this test: later tests see the built-in methods alone
    monkeypatch.setattr(METHODS, "_entries", dict(METHODS._entries))
    request.addfinalizer(lambda: sys.modules.pop("toy_method", None))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("toy_method")  # registers "toy" in this process, as a user's import would

    model = mmpt.load(run_dir)
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    image_features, text_features = model(images, torch.tensor([[5, 6, 0], [7, 0, 0]]))
    assert image_features.shape == text_features.shape == (2, 32)
    torch.testing.assert_close(text_features.norm(dim=-1), torch.ones(2))

    from mmpt.commands.export import main as export

    command = blocks("bash")[1].split()
    assert command[:3] == ["PYTHONPATH=path/to/folder", "python", "launch/export.py"]
    monkeypatch.chdir(tmp_path)
    assert export(command[3:]) == 0  # its check runs both towers under onnxruntime against the model
    out = tmp_path / command[command.index("--out") + 1]
    assert sorted(path.name for path in out.glob("*.onnx")) == ["image.onnx", "text.onnx"]
