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
anyway, and the carried folder stays well under the 64 MiB a transfer may hold.

The GPU image's versions (IMAGE: Python 3.12, torch 2.11 for CUDA 13, and the versions its package list
gives) are checked before anything is downloaded, against what the carried distributions ask for as
installed here, and again against the downloaded wheels: a wheel built for no Python 3.12 (cp311 only, say),
one built for another CUDA, or a requirement the image's version does not meet (a pin of torch to another
release) ends the script at once, with one line naming each. It then checks that every requirement of every
wheel is in the folder or on the image, prints the folder plus the working tree against the transfer limit,
and records what it carries, for what image, in `.whl/manifest.json` (run.sh compares that image with the
machine's; the suite's records carry the manifest).

    python benchmarks/gpu/prepare_wheels.py --check     # the checks alone, on the folder as it is
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

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
# The environment the wheels are for (the image's), to evaluate requirement markers.
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
# The GPU image (the device notes' KINDS.md): Python, CUDA, and the versions its package list gives. A wheel must
# install on this Python, and nothing carried may ask for other versions of these.
IMAGE_PYTHON = (3, 12)
IMAGE_CUDA = 13
IMAGE = {
    "python": "3.12",
    "cuda": "13",
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "torchaudio": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "numpy": "2.5.2",
    "accelerate": "1.15.0",
    "onnx": "1.23.1",
    "onnxruntime": "1.30.0",
    "onnxscript": "0.7.2",
}
IMAGE_GLIBC_MINOR = 39  # Ubuntu 24.04's glibc 2.39 (the image's Python is 3.12.3): manylinux_2_N for N up to this
CUDA_SUFFIX = re.compile(r"(?:-cu|cupy-cuda)(\d+)")  # nvidia-cudnn-cu12, cupy-cuda12x: built for that CUDA
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


def pip(*args: str, quiet_output: bool = False) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, capture_output=quiet_output, text=True)


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
        quiet_output=True,
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


def image_tags() -> set[Tag]:
    """Every wheel tag the image's Python installs: CPython 3.12 (and abi3 from older), manylinux x86_64, pure."""
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(IMAGE_GLIBC_MINOR, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return {
        *cpython_tags(
            IMAGE_PYTHON, abis=[f"cp{IMAGE_PYTHON[0]}{IMAGE_PYTHON[1]}", "abi3", "none"], platforms=platforms
        ),
        *compatible_tags(IMAGE_PYTHON, f"cp{IMAGE_PYTHON[0]}{IMAGE_PYTHON[1]}", platforms),
    }


def tag_conflicts(wheels: list[Path]) -> list[str]:
    """Wheels the image's Python would not install (built for other Pythons or platforms)."""
    supported, found = image_tags(), []
    for wheel in wheels:
        try:
            _, _, _, tags = parse_wheel_filename(wheel.name)
        except InvalidWheelFilename:
            found.append(f"{wheel.name} is not a wheel's name")
            continue
        if not tags & supported:
            built = ", ".join(sorted(str(t) for t in tags))
            found.append(f"{wheel.name} is built for {built}, not CPython {IMAGE['python']} manylinux x86_64")
    return found


def image_conflicts(requirements: list[tuple[str, Requirement]]) -> list[str]:
    """(who, requirement) pairs the image cannot meet: a version of an image package it does not have, or a
    package built for another CUDA."""
    found = []
    for who, requirement in requirements:
        name = canonical(requirement.name)
        cuda = CUDA_SUFFIX.search(name)
        if cuda and int(cuda.group(1)[:2]) != IMAGE_CUDA:
            found.append(f"{who} needs {requirement}, built for CUDA {cuda.group(1)}; the image has CUDA {IMAGE_CUDA}")
            continue
        if name not in IMAGE or not requirement.specifier:
            continue
        try:
            meets = requirement.specifier.contains(Version(IMAGE[name]), prereleases=True)
        except InvalidVersion:
            continue
        if not meets:
            found.append(f"{who} needs {requirement}; the image has {name} {IMAGE[name]}")
    return found


def installed_requirements(carry: dict[str, str]) -> list[tuple[str, Requirement]]:
    """What mmpt and each distribution to carry ask for, as installed here: checked before any download."""
    pairs = [("mmpt", r) for r in project_requirements()]
    for name, version in carry.items():
        pairs += [(f"{name} {version}", r) for r in runtime_requirements(name)]
    return pairs


def folder_requirements(wheels: list[Path]) -> list[tuple[str, Requirement]]:
    return [(wheel.name, r) for wheel in wheels for r in wheel_requirements(wheel)]


def fail(problems: list[str]) -> int:
    """One line for all of them."""
    print(f"prepare_wheels: cannot carry for the GPU image: {'; '.join(problems)}", file=sys.stderr)
    return 1


def carried_versions(wheels: list[Path], root: Path) -> dict[str, str]:
    found = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        found[str(wheel.relative_to(root).parent / name) if wheel.parent != root else str(name)] = str(version)
    return dict(sorted(found.items()))


def write_manifest(folder: Path, wheels: list[Path]) -> dict:
    """What the folder carries and for which image, with the versions the tests ran with here."""
    here: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "numpy", "deepspeed", "open_clip_torch"):
        try:
            here[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            here[name] = None
    manifest = {
        "image": IMAGE,
        "carried": carried_versions(wheels, folder),
        "tested_here_with": here,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def version_notes(here: dict[str, str | None]) -> list[str]:
    """Image packages whose version here (where the tests ran) is not the image's: they run there as the image has
    them, not as tested."""
    return [
        f"{name}: tested here with {version}, runs on the image's {IMAGE[name]}"
        for name, version in here.items()
        if version and name in IMAGE and Version(version.split("+")[0]).release[:2] != Version(IMAGE[name]).release[:2]
    ]


def download_or_fail(pins: list[str], into: Path) -> list[str]:
    """pip download; on failure, a line per requirement pip found no wheel of for the image."""
    try:
        download(pins, into)
    except subprocess.CalledProcessError as exc:
        output = (exc.stderr or "") + (exc.stdout or "")
        missing = re.findall(r"No matching distribution found for (\S+)", output)
        return [
            f"no wheel of {m} for CPython {IMAGE['python']} manylinux x86_64 on the index (built for other Pythons only?)"
            for m in missing
        ] or [f"pip download failed: {' '.join(output.split())[-300:]}"]
    return []


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
    parser.add_argument("--check", action="store_true", help="only check the folder as it is; download nothing")
    args = parser.parse_args()

    if not args.check:
        carry = needed_distributions(args.with_decord)
        problems = image_conflicts(installed_requirements(carry))
        if problems:
            return fail(problems)
        shutil.rmtree(args.dest, ignore_errors=True)
        args.dest.mkdir(parents=True)
        with tempfile.TemporaryDirectory() as scratch:
            problems = download_or_fail(
                [f"{n}=={v}" for n, v in carry.items() if n not in BUILT_FROM_SDIST], Path(scratch)
            )
            if problems:
                return fail(problems)
            for name in BUILT_FROM_SDIST & carry.keys():
                build_from_sdist(f"{name}=={carry[name]}", Path(scratch))
            for wheel in Path(scratch).glob("*.whl"):
                shutil.move(wheel, args.dest / wheel.name)
        problems = download_or_fail(OPEN_CLIP_TRAIN_DEPS, args.dest / "open_clip_train")
        if problems:
            return fail(problems)
    return check_folder(args.dest)


def check_folder(folder: Path) -> int:
    """The wheels against the image (tags, requirements), the closure, the size; the manifest written."""
    wheels = sorted(folder.rglob("*.whl"))
    if not wheels:
        return fail([f"no wheels in {folder}: run benchmarks/gpu/prepare_wheels.py without --check first"])
    problems = tag_conflicts(wheels) + image_conflicts(folder_requirements(wheels))
    problems += [f"{need}, found neither in {folder.name} nor on the image" for need in check_closure(folder)]
    size, tree = mib(wheels), working_tree_mib()
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.relative_to(folder)}")
    for reason in (f"carried although on the image: {n} ({why})" for n, why in CARRY_ANYWAY.items()):
        print(reason)
    manifest = write_manifest(folder, wheels)
    for note in version_notes(manifest["tested_here_with"]):
        print(note)
    total = size + tree
    print(
        f"wheels {size:.1f} MiB + working tree {tree:.1f} MiB = {total:.1f} MiB "
        f"(transfer limit {TRANSFER_LIMIT_MIB:.0f} MiB, {HEADROOM_MIB:.0f} MiB kept free)"
    )
    if total > TRANSFER_LIMIT_MIB - HEADROOM_MIB:
        problems.append(f"wheels and working tree take {total:.1f} MiB, over {TRANSFER_LIMIT_MIB - HEADROOM_MIB:.0f}")
    if problems:
        return fail(problems)
    print(
        f"{len(wheels)} wheels fit the GPU image (Python {IMAGE['python']}, torch {IMAGE['torch']}, CUDA {IMAGE['cuda']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
