"""`train.compile`: the towers a method declares (`EngineNeeds.compilable`), compiled in place with inductor.

For every method, a compiled engine and an eager one are built from the same config (the method's tiny
size, its demo data, fp32, 2 micro-batches per step) and take 2 optimizer steps on the same batches with the
same RNG; per step, the loss terms and the full gradient at the accumulation boundary must agree within
`LOSS_RTOL`, `GRAD_RTOL` and `PARAM_RTOL` (inductor fuses and reorders fp32 arithmetic; not bit-exact), the second
step after the optimizer applied the first; no loss term may differ by more than `LOSS_BOUND` (1e-3), whatever a
method's looser factors. Random ops in compiled code draw as eager ones do
(`torch._inductor.config.fallback_random`), so dropout matches too. The compiled model keeps the eager
model's state-dict keys.

Default tier: the refused combinations and `auto`. Extended tier (`pytest -m extended`): clip at ZeRO-0 in a world
of one, in this process; every method at ZeRO-2 on 2 gloo ranks (m2_encoder's pooled accumulation: a compiled pass
without gradient, then one with), m2_encoder at ZeRO-3 (DeepSpeed's parameter hooks between the compiled pieces);
a compiled clip run saved at step 2 and resumed continues as the uninterrupted compiled run. The matrix part
(`pytest -m matrix`): every method at ZeRO 0, 1 and 3 as well. Each method is compiled once per stage: inductor's
cold compilation (~30-60 s a method on 2 cores) is what these tests cost.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_config_matrix import shrink
from test_every_method import demo_config, one_process  # noqa: F401 (one_process is a fixture)

from conftest import read_metrics, run_on_gloo_ranks, threads_per_rank
from mmpt.methods import list_methods

# Inductor fuses and reorders fp32 sums; VICTOR's temperature (1/0.07) and batch norm over 4 rows amplify that
# to 5e-5 (measured, relative) in its loss terms. A tower compiled wrong is off by far more.
LOSS_RTOL = 2e-4  # each loss term, relative
GRAD_RTOL = 1e-3  # the whole gradient (all parameters as one vector), relative L2 error
PARAM_RTOL = 5e-3  # each parameter holding at least 1% of the gradient's norm, relative L2 error
# After the first update, 10x: Adam moves each weight by about lr * sign(gradient), so a gradient element near
# zero that rounds the other way moves a whole learning rate the other way (2.7e-4 measured on VICTOR's terms).
AFTER_UPDATE = 10
# VICTOR: its projection heads' batch norm over 4 rows and its 1/0.07 temperatures amplify the reordering further:
# its text tower's gradients differ by 3e-3 and the whole gradient by up to 2.3% (measured). clip: its demo ResNet's
# batch norm over micro-batches of 4 does too; how much depends on the batches drawn and differs between runs
# (whole gradient, measured: 2.3e-3 to 1.1e-2 at the first step, up to 1.5e-2 after it).
LOOSER = {"victor": 50, "clip": 20}
# Whatever the method, stage and step, no loss term may differ by more (relative). Measured with an empty cache: at
# most 2.4e-4 (VICTOR's dual_vsa after the update), clip 1.5e-4, every other method below 3e-7.
LOSS_BOUND = 1e-3
STEPS, ACCUM = 2, 2


def make_config(name: str, corpora: dict, run_dir: Path, stage: int, compiled: bool, *extra: str):
    from mmpt.config_loader import load_config

    config = demo_config(name)
    overrides = [
        *shrink(config, corpora),
        "data.train.num_workers=0",
        f"run.output_dir={run_dir}",
        f"train.zero_stage={stage}",
        "train.precision=fp32",
        f"train.grad_accum={ACCUM}",
        f"train.compile={str(compiled).lower()}",
        *extra,
    ]
    return load_config(config, overrides)


def steps_of(name: str, corpora: dict, run_dir: Path, stage: int, compiled: bool, rank: int, world: int):
    """(per step: the loss terms and the full gradient; the model's state-dict keys; graphs compiled)."""
    from deepspeed.utils import safe_get_full_grad
    from torch._dynamo.utils import counters

    from mmpt import distributed as mdist
    from mmpt.data.loader import StatefulLoader
    from mmpt.engine.compile import is_compiled, regions
    from mmpt.engine.run import build_engine, seed_everything
    from mmpt.engine.trainer import optimizer_step
    from mmpt.methods import get_method

    method = get_method(name)
    cfg = make_config(name, corpora, run_dir, stage, compiled)
    run_dir.mkdir(parents=True, exist_ok=True)
    method.prepare(cfg, run_dir)
    graphs_before = counters["stats"]["unique_graphs"]
    engine, _, _ = build_engine(cfg, method, mdist.ParallelLayout.whole_world(), world)
    towers = engine.module.needs.compilable
    assert towers, f"method '{name}' declares no tower to compile"
    assert [all(is_compiled(r) for r in regions(t)) for t in towers] == [compiled] * len(towers)
    batches = iter(StatefulLoader(method.train_data(cfg, run_dir, rank=rank, world_size=world)))
    named = list(engine.module.model.named_parameters())
    recorded: list[dict] = []
    apply_step = engine.step

    def step_capturing_the_gradient():
        if engine.is_gradient_accumulation_boundary():
            grads = {n: safe_get_full_grad(p) for n, p in named}
            recorded[-1]["grads"] = {n: g.detach().clone() for n, g in grads.items() if g is not None}
        apply_step()

    engine.step = step_capturing_the_gradient
    for step in range(STEPS):
        micro_batches = [next(batches) for _ in range(ACCUM)]
        seed_everything(1000 + step)
        recorded.append({})
        terms = optimizer_step(engine, micro_batches)
        recorded[-1]["terms"] = {k: v.detach().clone() for k, v in terms.items()}
    keys = list(engine.module.model.state_dict())
    engine.destroy()
    return recorded, keys, counters["stats"]["unique_graphs"] - graphs_before


def compare(name: str, eager: list[dict], compiled: list[dict]) -> None:
    for step, (ref, mine) in enumerate(zip(eager, compiled, strict=True), start=1):
        scale = (1 if step == 1 else AFTER_UPDATE) * LOOSER.get(name, 1)
        assert ref["terms"].keys() == mine["terms"].keys()
        for term, value in ref["terms"].items():
            torch.testing.assert_close(
                mine["terms"][term],
                value,
                rtol=min(LOSS_RTOL * scale, LOSS_BOUND),
                atol=0,
                msg=lambda m, step=step, term=term: f"{name} step {step}: loss term '{term}': {m}",
            )
        assert ref["grads"].keys() == mine["grads"].keys(), f"{name} step {step}: other parameters have gradients"
        whole = torch.cat([g.flatten() for g in ref["grads"].values()]).norm()
        error = torch.cat([(mine["grads"][n] - g).flatten() for n, g in ref["grads"].items()]).norm() / whole
        assert error <= GRAD_RTOL * scale, f"{name} step {step}: the gradient differs by {error:.2e} (relative)"
        for param, g in ref["grads"].items():
            if g.norm() >= 0.01 * whole:
                error = (mine["grads"][param] - g).norm() / g.norm()
                assert error <= PARAM_RTOL * scale, f"{name} step {step}: gradient of {param} differs by {error:.2e}"


def check_compiled_step_matches_eager(rank: int, root: str, name: str, corpora: dict, stage: int, world: int):
    import torch._inductor.config

    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        eager, eager_keys, _ = steps_of(name, corpora, Path(root, f"eager-{rank}"), stage, False, rank, world)
        compiled, keys, graphs = steps_of(name, corpora, Path(root, f"compiled-{rank}"), stage, True, rank, world)
    assert graphs > 0, f"{name}: the compiled run compiled no graph"
    assert keys == eager_keys, f"{name}: compiling changed the state-dict keys"
    compare(name, eager, compiled)


def start_world_of_one() -> int:
    import torch.distributed as dist

    from mmpt import distributed as mdist
    from mmpt.engine.run import start_process_group

    mdist.ensure_rendezvous_env()  # a module before may have removed the variables of the group still running
    if not dist.is_initialized():
        start_process_group(1800.0)
    return mdist.get_world_size()


@pytest.fixture
def threads_of_a_rank():
    """This process computes with the threads of a rank of a 2-rank world while it compiles. Inductor's CPU kernels
    are specialised to the thread count, so the kernels the 2-rank check compiled for the same towers and shapes
    come from inductor's cache instead of a cold compilation (clip at ZeRO-0: 11 s against 58 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(2))
    yield
    torch.set_num_threads(threads)


@pytest.mark.extended
def test_every_method_compiled_at_zero2_on_two_ranks(corpora, tmp_path):
    """The methods one after another in one world of 2 ranks (a world's start costs more than a check). First in
    this file: the checks in this process then find clip's kernels in inductor's cache."""
    checks = [("check_compiled_step_matches_eager", (str(tmp_path / n), n, corpora, 2, 2)) for n in list_methods()]
    run_on_gloo_ranks("test_compile", checks, world=2)


@pytest.mark.extended
@pytest.mark.matrix
@pytest.mark.parametrize(("stage", "name"), [(s, n) for s in (0, 1, 3) for n in list_methods()])
def test_every_method_compiled_at_the_other_stages_on_two_ranks(stage, name, corpora, tmp_path):
    """The rest of the matrix, every method at ZeRO 0, 1 and 3 (at 0 and 1 the ZeRO-2 check's kernels are reused;
    ZeRO-3's graphs break at DeepSpeed's parameter hooks and are compiled anew)."""
    run_on_gloo_ranks(
        "test_compile", [("check_compiled_step_matches_eager", (str(tmp_path), name, corpora, stage, 2))], 2
    )


@pytest.mark.slow
@pytest.mark.usefixtures("threads_of_a_rank")
def test_compiled_step_matches_eager_at_zero0(corpora, one_process, tmp_path):  # noqa: F811
    assert start_world_of_one() == 1
    check_compiled_step_matches_eager(0, str(tmp_path), "clip", corpora, 0, 1)


def test_compiled_step_matches_eager_at_zero3_on_two_ranks(corpora, tmp_path):
    """ZeRO-3's parameter hooks stay out of the compiled graphs (DeepSpeed keeps them eager): the same step."""
    run_on_gloo_ranks(
        "test_compile", [("check_compiled_step_matches_eager", (str(tmp_path), "m2_encoder", corpora, 3, 2))], world=2
    )


@pytest.mark.slow
@pytest.mark.usefixtures("threads_of_a_rank")
def test_resumed_compiled_run_continues_as_the_uninterrupted_one(corpora, one_process, tmp_path):  # noqa: F811
    """Compiled clip: 3 steps in one go; then a new run resumed from that run's step-2 checkpoint: the same third
    step (loss, then weights). Resuming from the uninterrupted run's own checkpoint starts both third steps from
    identical weights, optimizer state, data position and RNG, so only the kernels of one step can differ."""
    from safetensors.torch import load_file

    from mmpt.engine import train

    start_world_of_one()
    steps = ["train.save_every=2", "train.eval_every=0", "optim.min_lr_ratio=1.0", "train.log_every=1"]

    def run(run_dir: Path, *extra: str) -> dict[int, float]:
        torch._dynamo.reset()  # each start is a new process for a user: nothing compiled, no shapes seen
        train(make_config("clip", corpora, run_dir, 0, True, *steps, "train.max_steps=3", *extra))
        return {r["step"]: r["loss/total"] for r in read_metrics(run_dir) if "loss/total" in r}

    whole = run(tmp_path / "whole")
    checkpoint = tmp_path / "whole/checkpoints/step_000000002"
    assert (checkpoint / "complete.json").is_file(), "no complete checkpoint at step 2"
    resumed = run(tmp_path / "resumed", f"run.resume={checkpoint}")
    assert sorted(resumed) == [3], f"logged steps {sorted(resumed)}: the run did not resume at 2"
    # Compiled CPU kernels are not bit-stable from one compilation to the next (~2e-7 relative on a step's loss);
    # a resume at another batch moves the loss by over 1e-1 (steps' losses differ by 0.3-1.9 here).
    assert resumed[3] == pytest.approx(whole[3], rel=1e-5, abs=0), f"resumed {resumed}, uninterrupted {whole}"
    final, expected = (
        load_file(str(tmp_path / "resumed/model.safetensors")),
        load_file(str(tmp_path / "whole/model.safetensors")),
    )
    assert final.keys() == expected.keys()
    # One Adam step from identical states: every element within 1e-4 relative, except where a gradient is ~0 and
    # the kernels' noise decides its sign (a dead ReLU's weights): Adam moves those by up to ~lr (1e-3 here) either
    # way. A wrong resume moves most elements by that much.
    for key, value in expected.items():
        difference = (final[key] - value).abs()
        assert difference.max() <= 3e-3, f"{key}: moved {difference.max():.2e}, more than an Adam step"
        off = int((difference > 1e-6 + 1e-4 * value.abs()).sum())
        assert off <= max(2, value.numel() // 1000), f"{key}: {off} of its {value.numel()} elements differ"


@pytest.mark.parametrize(("override", "names"), [("train.sequence_parallel=2", "train.sequence_parallel=2")])
def test_compile_refuses_what_does_not_compose(override, names, corpora, tmp_path):
    from mmpt import distributed as mdist
    from mmpt.config import ConfigError
    from mmpt.engine.run import build_engine
    from mmpt.methods import get_method

    cfg = make_config("clip", corpora, tmp_path, 0, True, override)
    with pytest.raises(ConfigError) as error:  # before anything is built
        build_engine(cfg, get_method("clip"), mdist.ParallelLayout.whole_world(), 1)
    message = str(error.value)
    assert "'train.compile'" in message and names in message and "\n" not in message, message


def test_a_method_without_towers_cannot_compile():
    from mmpt.config import ConfigError
    from mmpt.engine.compile import compile_towers
    from mmpt.methods import EngineNeeds

    with pytest.raises(ConfigError, match="'train.compile': method 'toy' declares no tower"):
        compile_towers(EngineNeeds(), "toy", 0)


def test_multihead_attention_declares_its_projection_at_zero3(corpora, tmp_path):
    """torch's nn.MultiheadAttention (open_clip's) reads out_proj's parameters without calling it, so at ZeRO-3 they
    are registered as the attention's external parameters, which its hook gathers before a compiled block runs (the
    matrix part's open_clip cell at ZeRO-3 fails on a partitioned weight without it); other stages register none."""
    from test_locking import tiny
    from torch import nn

    from mmpt.engine.compile import compile_towers

    cfg, method, model = tiny("open_clip", corpora, tmp_path)
    attention = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert attention and compile_towers(method.engine_needs(model, cfg), "open_clip", 2) > 0
    assert not any(getattr(m, "_external_params", None) for m in attention)
    compile_towers(method.engine_needs(model, cfg), "open_clip", 3)
    for module in attention:
        assert [id(p) for _, p in module.ds_external_parameters()] == [id(p) for p in module.out_proj.parameters()]


@pytest.mark.parametrize(
    ("override", "gpu", "towers", "expected"),
    [
        ("train.zero_stage=2", True, True, True),
        ("train.zero_stage=2", False, True, False),  # CPU ranks: eager
        ("train.zero_stage=3", True, True, False),  # what does not compose is left eager, not refused
        ("train.sequence_parallel=2", True, True, False),
        ("train.zero_stage=0", True, False, False),  # nothing declared to compile
    ],
)
def test_auto_compiles_gpu_runs_where_compilation_composes(override, gpu, towers, expected, corpora, tmp_path):
    from torch import nn

    from mmpt.engine.compile import check_compile, compiles
    from mmpt.methods import EngineNeeds

    cfg = make_config("clip", corpora, tmp_path, 0, False, override, "train.compile=auto")
    check_compile(cfg)  # auto refuses nothing
    needs = EngineNeeds(compilable=(nn.Linear(2, 2),) if towers else ())
    assert compiles(cfg, needs, gpu=gpu) is expected


def test_a_deeper_tower_traces_no_more_to_compile():
    """Blocks of a stack are compiled one by one and share one compilation: a tower of 6 blocks traces as many
    operations as one of 2 (one block's), where compiling it whole traces every block, more with depth."""
    from torch import nn
    from torch._dynamo.utils import counters

    from mmpt.engine.compile import compile_towers, is_compiled, regions
    from mmpt.methods import EngineNeeds

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(self.norm(x)).relu()

    def traced(depth: int, whole: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        tower = nn.Sequential(nn.Linear(8, 16), nn.Sequential(*(Block() for _ in range(depth))), nn.LayerNorm(16))
        if whole:
            tower.compile()
        else:
            assert compile_towers(EngineNeeds(compilable=(tower,)), "toy", 0) == depth
            assert all(is_compiled(block) for block in regions(tower)) and not is_compiled(tower)
        tower(torch.randn(4, 8, requires_grad=True)).sum().backward()
        return counters["stats"]["calls_captured"]

    assert traced(2, whole=False) == traced(6, whole=False)
    assert traced(6, whole=True) > traced(2, whole=True) > traced(2, whole=False)
