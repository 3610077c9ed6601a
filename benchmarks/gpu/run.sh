#!/usr/bin/env bash
# One command of the GPU benchmark suite, on a machine with torch and CUDA but no network:
#
#   bash benchmarks/gpu/run.sh --group 1      # each group of `python benchmarks/gpu/suite.py --plan`, in order
#   bash benchmarks/gpu/run.sh [suite.py options]      e.g.  --only loss_memory --budget 120
#
# from the repository root, with the wheel folder made by benchmarks/gpu/prepare_wheels.py at .whl/
# (or MMPT_WHEELS=folder). It installs the wheels into /tmp/site (MMPT_SITE), lays out the mmpt package
# from the working tree, prints the machine, and runs benchmarks/gpu/suite.py, which counts a group's
# time from this script's start. Results in $OUT when it is set (benchmarks/results/gpu/ without it):
# stage-<name>.json as each stage ends, gpu.md and gpu.json rebuilt each time, logs.tar.gz, and suite.log.
export MMPT_GPU_COMMAND_START=${MMPT_GPU_COMMAND_START:-$(date +%s)}
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
wheels=${MMPT_WHEELS:-$repo/.whl}
site=${MMPT_SITE:-/tmp/site}
work=${MMPT_GPU_WORK:-/tmp/mmpt-gpu-bench}
python=${PYTHON:-python3}
log=${OUT:-$work}/suite.log
mkdir -p "$work" "$(dirname "$log")"

if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $wheels: run python benchmarks/gpu/prepare_wheels.py where pip reaches PyPI, and carry .whl" >&2
    exit 2
fi
install() {  # offline, no dependency resolution: the folder holds exactly what the image lacks
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"
}
install "$site" "$wheels"/*.whl || exit 1
# open_clip's trainer reads shards with webdataset 0.2; mmpt with 1.x: a folder of its own, first on its path only.
install "$site-open_clip_train" "$wheels"/open_clip_train/*.whl || exit 1
export MMPT_OPEN_CLIP_TRAIN_PATH="$site-open_clip_train"

# pyproject.toml installs data/ as mmpt.data and losses/ as mmpt.losses; without an install, links give that
# layout and keep the working tree's code live.
src=/tmp/mmpt-src
rm -rf "$src" && mkdir -p "$src/mmpt"
for entry in "$repo"/mmpt/*; do ln -s "$entry" "$src/mmpt/"; done
ln -s "$repo/data" "$src/mmpt/data"
ln -s "$repo/losses" "$src/mmpt/losses"
export PYTHONPATH="$site:$src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

{
    echo "== machine"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    # From another folder: the repository root on sys.path would shadow the mmpt layout above.
    cd /tmp && MMPT_REPO=$repo "$python" - <<'EOF'
import platform
from importlib import metadata

import torch

print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, GPUs {torch.cuda.device_count()}"
      + (f": {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
for name in ("deepspeed", "open_clip_torch", "webdataset", "pydantic", "av", "decord", "timm", "transformers"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name}: not installed")
import mmpt.data, mmpt.losses, mmpt.engine  # the layout above works
EOF
} 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "the environment check failed: see above" >&2; exit 1; }

# The suite writes each stage's record and logs.tar.gz as the stage ends: nothing is left to do after it.
"$python" benchmarks/gpu/suite.py --work "$work" "$@" 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
