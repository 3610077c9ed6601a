"""Fill `.whl/` with what the GPU machine's image lacks, so `benchmarks/gpu/run.sh` installs it offline.

The image has Python 3.12 with torch (CUDA 13), transformers, timm, numpy and the rest of ON_IMAGE, but no
network. Run this here, where pip reaches PyPI, with the project's virtualenv active:

    python benchmarks/gpu/prepare_wheels.py       # .whl/, about 44 MiB

It carries every distribution mmpt's dependencies (pyproject.toml, with the bench extra) need, transitively, less
what the image has, at the versions installed here: cp312 manylinux x86_64 wheels from PyPI, and deepspeed and
PyTurboJPEG built from their sdists as pure Python (deepspeed with DS_BUILD_OPS=0: mmpt uses none of its compiled
ops). open_clip's trainer reads shards with webdataset 0.2, which mmpt's 1.x replaced: it goes to
`.whl/open_clip_train/`, which run.sh installs into a folder of its own. decord is left out (VICTOR then decodes
with PyAV). A call carries 64 MiB with the working tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DEST = REPO / ".whl"
# The image's environment, to evaluate requirement markers.
TARGET = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
# On the image already, as far as mmpt's dependency tree reaches them (their own requirements are not followed).
# fmt: off
ON_IMAGE = {
    "torch", "torchvision", "numpy", "pillow", "pyyaml", "tqdm", "regex", "huggingface-hub", "safetensors",
    "transformers", "tokenizers", "sentencepiece", "tensorboard", "scikit-learn", "scipy", "pandas", "psutil",
    "einops", "msgpack", "ninja", "packaging", "py-cpuinfo", "nvidia-ml-py", "fsspec", "filelock", "jinja2",
    "networkx", "sympy", "triton", "matplotlib", "protobuf", "requests",
}
# fmt: on
# timm and typing-extensions are on the image too, but older than open_clip 3.3 and pydantic 2.14 need: carried.
LEFT_OUT = {"decord"}
# Pure Python, published as source only: built into wheels here (deepspeed without its compiled ops).
FROM_SOURCE = {"deepspeed", "pyturbojpeg"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(texts: list[str]) -> list[str]:
    found = [Requirement(t) for t in texts]
    return [canonical(r.name) for r in found if r.marker is None or r.marker.evaluate(TARGET)]


def needed() -> dict[str, str]:
    """{name: version installed here} of every distribution to carry."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pending = requirements([*project["dependencies"], *project["optional-dependencies"]["bench"]])
    carry: dict[str, str] = {}
    while pending:
        name = pending.pop()
        if name in carry or name in ON_IMAGE or name in LEFT_OUT:
            continue
        try:
            carry[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{name} is needed but not installed here: activate the project's virtualenv first")
        pending += requirements(metadata.requires(name) or [])
    return dict(sorted(carry.items()))


def pip(*args: str) -> None:
    print("+ pip", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def main() -> int:
    carry = needed()
    shutil.rmtree(DEST, ignore_errors=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    binary = ["download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    with tempfile.TemporaryDirectory() as scratch:
        pip(*binary, *platforms, "--dest", scratch, *[f"{n}=={v}" for n, v in carry.items() if n not in FROM_SOURCE])
        os.environ["DS_BUILD_OPS"] = "0"
        for name in FROM_SOURCE & carry.keys():
            build = ["wheel", "--no-deps", "--no-build-isolation", "--no-binary", name, "--wheel-dir", scratch]
            pip(*build, f"{name}=={carry[name]}")
        shutil.copytree(scratch, DEST)
    pip(*binary, *platforms, "--dest", str(DEST / "open_clip_train"), "webdataset==0.2.86")
    wheels = sorted(DEST.rglob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB, in {DEST}: carry `.whl` with each run.sh command")
    return 0


if __name__ == "__main__":
    sys.exit(main())
