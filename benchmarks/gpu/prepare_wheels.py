"""Fill `.whl/` with what the GPU machine's image lacks, so `benchmarks/gpu/run.sh` installs it offline.

The GPU image has Python 3.12 with torch (CUDA), transformers, timm, tokenizers, sentencepiece,
safetensors, tensorboard, scikit-learn, pandas and more, but no network. Run this here, where pip
reaches PyPI, with the project's virtualenv active:

    python benchmarks/gpu/prepare_wheels.py            # .whl/ (about 40 MiB)
    python benchmarks/gpu/prepare_wheels.py --with-decord   # + decord (13 MiB), VICTOR's default decoder

What goes in: every distribution that mmpt's dependencies (pyproject.toml) need, transitively, minus
those the image provides, at the versions installed here (the versions the tests ran with):

- cp312 manylinux x86_64 wheels downloaded from PyPI (`pip download --only-binary`);
- deepspeed built here from its sdist with DS_BUILD_OPS=0: pure Python, its ops JIT-built on use
  (mmpt uses none: torch's AdamW, NCCL through torch);
- `.whl/open_clip_train/webdataset-0.2.86`: open_clip's trainer reads shards with the 0.2 API that
  webdataset 1.x (mmpt's) removed, so run.sh installs it into a folder of its own, put first on the
  path of the open_clip runs only (as benchmarks/train_throughput.py does on CPU).

decord is left out unless asked: without it VICTOR decodes with PyAV, which the shard builder needs
anyway, and the carried folder stays well under the 64 MiB a transfer may hold. The script ends by
checking that every requirement of every wheel is either in the folder or on the image, and that the
folder plus the working tree fit in the transfer limit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PYTHON_VERSION = "3.12"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# The environment the wheels are for, to evaluate requirement markers (python_version set by --python-version).
TARGET = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
# On the GPU image already (its package list), as far as mmpt's dependency tree reaches them. Their own
# requirements are the image's business and are not followed.
ON_IMAGE = {
    "torch",
    "torchvision",
    "numpy",
    "pillow",
    "pyyaml",
    "tqdm",
    "regex",
    "huggingface-hub",
    "safetensors",
    "transformers",
    "tokenizers",
    "sentencepiece",
    "tensorboard",
    "scikit-learn",
    "scipy",
    "pandas",
    "psutil",
    "einops",
    "msgpack",
    "ninja",
    "packaging",
    "py-cpuinfo",
    "nvidia-ml-py",
    "fsspec",
    "filelock",
    "jinja2",
    "networkx",
    "sympy",
    "triton",
    "matplotlib",
    "protobuf",
    "requests",
    "typing-extensions",
    "timm",
}
# On the image, but carried all the same: the image's version is not recorded and mmpt's stack needs a recent one.
CARRY_ANYWAY = {
    "typing-extensions": "pydantic 2.14 needs typing-extensions>=4.16",
    "timm": "open_clip 3.3 needs timm>=1.0.17; VICTOR builds timm's ViT blocks",
}
OPTIONAL = {"decord"}  # added with --with-decord
BUILT_FROM_SDIST = {"deepspeed"}
OPEN_CLIP_TRAIN_DEPS = ["webdataset==0.2.86"]
TRANSFER_LIMIT_MIB = 64.0
HEADROOM_MIB = 6.0  # the other files of the working tree may grow; fail before the transfer does


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements() -> list[Requirement]:
    """mmpt's dependencies from pyproject.toml, plus the bench extra's (open_clip_train reads braceexpand)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [*project["dependencies"], *project["optional-dependencies"]["bench"]]
    return [r for r in map(Requirement, names) if r.marker is None or r.marker.evaluate(TARGET)]


def runtime_requirements(name: str) -> list[Requirement]:
    """Requirements of an installed distribution that apply on the target (no extras)."""
    found = []
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(TARGET):
            found.append(requirement)
    return found


def needed_distributions(with_decord: bool) -> dict[str, str]:
    """{name: version installed here} of every distribution to carry (the closure of mmpt's needs, less the image)."""
    pending = [canonical(r.name) for r in project_requirements()]
    carry: dict[str, str] = {}
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in OPTIONAL and not with_decord:
            continue
        if name in ON_IMAGE and name not in CARRY_ANYWAY:
            continue
        try:
            carry[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{name} is needed but not installed here: activate the project's virtualenv first")
        pending += [canonical(r.name) for r in runtime_requirements(name)]
    return dict(sorted(carry.items()))


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def download(pins: list[str], into: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip(
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        TARGET["python_version"],
        "--implementation",
        "cp",
        *platforms,
        "--dest",
        str(into),
        *pins,
    )


def build_from_sdist(pin: str, into: Path) -> None:
    """A pure-Python wheel from the sdist (no compiled ops), built against the torch installed here."""
    os.environ["DS_BUILD_OPS"] = "0"
    pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-cache-dir",
        "--no-binary",
        pin.split("==")[0],
        "--wheel-dir",
        str(into),
        pin,
    )


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate(TARGET):
                found.append(requirement)
    return found


def wheel_name(wheel: Path) -> str:
    return canonical(wheel.name.split("-")[0])


def check_closure(folder: Path) -> list[str]:
    """Requirements of the carried wheels (sub-folders included: they are installed on top) that neither the
    folder nor the image satisfies."""
    wheels = sorted(folder.rglob("*.whl"))
    carried = {wheel_name(w) for w in wheels}
    missing = []
    for wheel in wheels:
        for requirement in wheel_requirements(wheel):
            name = canonical(requirement.name)
            if name not in carried and name not in ON_IMAGE:
                missing.append(f"{wheel.name} needs {requirement}")
    return missing


def mib(paths: list[Path]) -> float:
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


def working_tree_mib() -> float:
    """Tracked files plus untracked ones git does not ignore: what travels besides the carried folder."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    return mib([REPO / p for p in listed if p])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="the folder to fill (emptied first)")
    parser.add_argument("--with-decord", action="store_true", help="also carry decord (13 MiB)")
    parser.add_argument("--python-version", default=PYTHON_VERSION, help="of the machine the wheels are for")
    args = parser.parse_args()
    TARGET.update(python_version=args.python_version, python_full_version=f"{args.python_version}.0")

    carry = needed_distributions(args.with_decord)
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        download([f"{n}=={v}" for n, v in carry.items() if n not in BUILT_FROM_SDIST], Path(scratch))
        for name in BUILT_FROM_SDIST & carry.keys():
            build_from_sdist(f"{name}=={carry[name]}", Path(scratch))
        for wheel in Path(scratch).glob("*.whl"):
            shutil.move(wheel, args.dest / wheel.name)
    download(OPEN_CLIP_TRAIN_DEPS, args.dest / "open_clip_train")

    missing = check_closure(args.dest)
    wheels = sorted(args.dest.rglob("*.whl"))
    folder, tree = mib(wheels), working_tree_mib()
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.relative_to(args.dest)}")
    print(
        f"wheels {folder:.1f} MiB + working tree {tree:.1f} MiB = {folder + tree:.1f} MiB "
        f"(transfer limit {TRANSFER_LIMIT_MIB:.0f} MiB)"
    )
    for reason in (f"carried although on the image: {n} ({why})" for n, why in CARRY_ANYWAY.items()):
        print(reason)
    if missing:
        print("requirements found nowhere:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    if folder + tree > TRANSFER_LIMIT_MIB - HEADROOM_MIB:
        print(f"too large: keep {HEADROOM_MIB:.0f} MiB of headroom under the transfer limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
