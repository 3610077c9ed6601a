import ast
import importlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    from mmpt.demo.digits import build_digits

    return build_digits(tmp_path_factory.mktemp("data") / "digits", captions_per_image=2, shard_size=400)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """`module_tmp(name)`: a folder for runs a test module shares, removed when the module ends.

    Their checkpoints are large; kept to the session's end they would add up to several GB of disk.
    """
    made: list[Path] = []

    def make(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def process_group_of_one():
    """The process group of in-process training (`mmpt.engine.train` in the test process): a world of one that
    the first run starts and every later one reuses, destroyed when the session ends. Not one per module:
    DeepSpeed keeps the groups of its first start (deepspeed.utils.groups), and a process group destroyed and
    started again would leave it holding dead ones.

    A world of one never routes a collective through DeepSpeed's shared-memory all-reduce
    (`mmpt.engine.shm_collectives`), so its C++ op is not built here: uncached, that compile takes a minute or
    more, longer than the runs themselves."""
    import torch.distributed as dist

    backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` as an attribute is torch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "build_shm_op", lambda: None)
        yield
    if dist.is_initialized():
        dist.destroy_process_group()


SMALL_MOVING_DIGITS = {"clips_per_kind": 12, "test_clips_per_kind": 6, "shard_size": 8}


@pytest.fixture(scope="session")
def moving_digits_root(tmp_path_factory) -> Path:
    """A small moving-digits corpus: 24 training clips (English and Chinese shards), 12 held out."""
    from mmpt.demo.moving_digits import build_moving_digits

    return build_moving_digits(tmp_path_factory.mktemp("video") / "moving_digits", **SMALL_MOVING_DIGITS)


def tiny_config(digits_root: Path, run_dir: Path, **sections) -> dict:
    """A small clip config on the digits corpus; `sections` deep-update it."""
    cfg = {
        "extends": [str(REPO / "configs/base/zero2.yaml"), str(REPO / "configs/base/optim_adamw.yaml")],
        "method": {
            "name": "clip",
            "tokenizer": str(digits_root / "tokenizer.json"),
            "embed_dim": 32,
            "image": {"timm_name": "resnet10t", "image_size": 32},
            "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16, "dropout": 0.1},
            "zeroshot": {"dataset": None},
        },
        "data": {
            "train": {
                "sources": [
                    {"shards": str(digits_root / "train/en-*.tar")},
                    {"shards": str(digits_root / "train/zh-*.tar")},
                ],
                "batch_size": 16,
                "num_workers": 1,
                "shuffle_buffer": 100,
            }
        },
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"max_steps": 8, "log_every": 1, "save_every": 4, "keep_last": 3},
        "run": {"output_dir": str(run_dir), "progress_bar": False, "tensorboard": False},
    }
    return _deep_update(cfg, sections)


def _deep_update(base: dict, top: dict) -> dict:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_command(config: Path, *overrides: str, ranks: int = 2) -> list[str]:
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    return [
        launcher,
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(free_port()),
        str(REPO / "launch/train.py"),
        "--config",
        str(config),
        *overrides,
    ]


def run_deepspeed(
    config: Path, *overrides: str, ranks: int = 2, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        deepspeed_command(config, *overrides, ranks=ranks),
        cwd=REPO,
        env={**launcher_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def launcher_env() -> dict:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_metrics(run_dir) if "loss/total" in r}


def _gloo_worker(rank, world, port, module, checks, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        functions = importlib.import_module(module)
        for name, args in checks:
            getattr(functions, name)(rank, *args)
        dist.barrier()  # nobody leaves (taking the rendezvous store with rank 0) while others still work
        queue.put((rank, None))
    except Exception as exc:  # reported to the test process
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(module: str, checks: list[tuple[str, tuple]], world: int) -> None:
    """Run `module.<name>(rank, *args)` for each check on `world` spawned gloo ranks; fail with every rank's error."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    processes = [
        ctx.Process(target=_gloo_worker, args=(rank, world, port, module, checks, queue)) for rank in range(world)
    ]
    for p in processes:
        p.start()
    errors = [queue.get(timeout=900) for _ in processes]
    for p in processes:
        p.join(timeout=300)
    failures = [f"rank {rank}: {error}" for rank, error in errors if error]
    assert not failures, "\n".join(failures)


GLM_SPECIAL_PIECES = [
    "[CLS]",
    "<|endoftext|>",
    "[MASK]",
    "[UNK]",
    "[SEP]",
    "[gMASK]",
    *(f"<|blank_{n}|>" for n in range(10, 1, -1)),
]


@pytest.fixture(scope="session")
def glm_sp_model(tmp_path_factory) -> Path:
    """A small SentencePiece model shaped like the GLM tokenizer's: BPE, NFKC with a dummy prefix, extra
    whitespace kept, the special tokens and blank runs as user-defined pieces. Trained here (well under a
    second), so tests of the tokenizer's rules need no download."""
    import sentencepiece

    corpus = [
        "a photo of a cat",
        "a photo of a dog on the grass",
        "the cat is here",
        "leading and trailing words",
        "一只猫的照片",
        "一只狗在草地上",
        "这是一张照片",
        "new line and tab",
        "numbers 1 2 3 4 5 6 7 8 9 0",
    ]
    path = tmp_path_factory.mktemp("glm") / "sp.model"
    with open(path, "wb") as handle:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus * 20),
            model_writer=handle,
            vocab_size=120,
            model_type="bpe",
            user_defined_symbols=GLM_SPECIAL_PIECES,
            normalization_rule_name="nmt_nfkc",
            remove_extra_whitespaces=False,
            character_coverage=1.0,
            minloglevel=2,
        )
    return path


def adam_state(run_dir, step):
    """(Adam's step count, norm of its second moment over every rank's partition) saved at `step`."""
    import torch

    counts, squares = set(), 0.0

    def visit(node):
        nonlocal squares
        if isinstance(node, dict):
            if "exp_avg_sq" in node and "step" in node:
                counts.add(int(node["step"]))
                squares += float(node["exp_avg_sq"].double().square().sum())
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    for path in sorted((run_dir / f"checkpoints/step_{step:09d}").glob("*optim_states.pt")):
        visit(torch.load(path, map_location="cpu", weights_only=False))
    assert len(counts) == 1, counts
    return counts.pop(), squares**0.5


# Calls that start another process, by their dotted name as written: anything of subprocess, a
# multiprocessing context or process (`mp.get_context`, `ctx.Process`), `mp.spawn`, `os.system`.
_LAUNCH_MODULES = {"subprocess"}
_LAUNCH_NAMES = {"Popen", "Process", "get_context", "start_processes"}
_LAUNCH_CALLS = {"os.system", "mp.spawn", "multiprocessing.spawn"}
_TESTS = Path(__file__).resolve().parent


def _dotted(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def launches(function, _seen: dict | None = None) -> bool:
    """Whether `function` starts a process, itself or through a function of tests/ that it calls (read from
    the source: the launch helpers above, a spawned gloo world, a command run with subprocess)."""
    seen = {} if _seen is None else _seen
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or not Path(code.co_filename).resolve().is_relative_to(_TESTS):
        return False
    if code in seen:
        return seen[code]
    seen[code] = False  # recursion through itself adds nothing
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    called = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name and (name[0] in _LAUNCH_MODULES or name[-1] in _LAUNCH_NAMES or ".".join(name) in _LAUNCH_CALLS):
                seen[code] = True
                return True
            if len(name) == 1:
                called.append(name[0])
    found = any(launches(function.__globals__[n], seen) for n in called if callable(function.__globals__.get(n)))
    seen[code] = found
    return found


def _item_launches(item, seen: dict) -> bool:
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for definitions in info.name2fixturedefs.values() if info else ():
        functions += [d.func for d in definitions]
    return any(launches(f, seen) for f in functions if f is not None)


# In one process, but minutes on 2 cores: each trains until a behaviour is learned (300 steps of VICTOR's frame
# order head; fine-tuning the packaged MiniLM on an intent set three times). Out of the quick tier, in the default run.
SLOW = {
    "test_victor_model.py::test_frame_order_is_learned_when_the_frames_show_their_time",
    "test_intent_eval.py::test_dialoglue_folder_fixed_kshot_split_and_finetuning",
}


def pytest_collection_modifyitems(config, items):
    """The quick tier is what remains once launches and slow tests are set aside: `python -m pytest -m fast`.

    A test that starts another process (a launcher, spawned ranks, any command), in its body, a helper of
    tests/ or a fixture, is marked `launches` here and stays out of it, marked distributed or not."""
    seen: dict = {}
    for item in items:
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in SLOW:
            item.add_marker(pytest.mark.slow)
        if _item_launches(item, seen):
            item.add_marker(pytest.mark.launches)
        if not any(item.get_closest_marker(name) for name in ("distributed", "launches", "slow", "matrix")):
            item.add_marker(pytest.mark.fast)
