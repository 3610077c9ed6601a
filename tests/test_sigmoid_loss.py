"""SigLIP's sigmoid loss against the paper's formula computed independently in float64 on the whole global batch:
each rank's loss, the gradients of every rank's features, the scale's and the bias's, to 1e-6 (fp32 features),
on 1, 2 and 4 gloo ranks, for every exchange, tiled and untiled, with and without pooled accumulation, with
ranks holding different numbers of rows."""

import itertools

import pytest
import torch
import torch.distributed as dist

from conftest import run_on_gloo_ranks
from mmpt import distributed as mdist
from mmpt.losses.sigmoid import EXCHANGES, SigmoidLoss

DIM = 8
SCALE, BIAS = 7.5, -4.0  # logits well inside both tails of the sigmoid


def rows_of(rank: int, uneven: bool) -> int:
    return 2 + rank if uneven else 3


def global_batch(world: int, micro_batches: int, uneven: bool):
    """Every rank's features, laid out (rank, micro-batch, row): the same tensors on every rank."""
    generator = torch.Generator().manual_seed(world * 10 + micro_batches)
    counts = [micro_batches * rows_of(rank, uneven) for rank in range(world)]
    images = torch.nn.functional.normalize(torch.randn(sum(counts), DIM, generator=generator), dim=-1)
    texts = torch.nn.functional.normalize(images + 0.7 * torch.randn(sum(counts), DIM, generator=generator), dim=-1)
    return images, texts, counts


def paper_loss(images, texts, counts):
    """Per-rank losses and the gradients of their sum, float64: -1/n_r sum_i sum_j log(1 / (1 + exp(-z_ij l_ij)))."""
    x, y = images.double().requires_grad_(), texts.double().requires_grad_()
    t = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(BIAS, dtype=torch.float64, requires_grad=True)
    logits = t * x @ y.T + b
    z = 2 * torch.eye(len(x), dtype=torch.float64) - 1
    terms = torch.log1p(torch.exp(-z * logits))
    starts = [sum(counts[:r]) for r in range(len(counts))]
    losses = [terms[s : s + n].sum() / n for s, n in zip(starts, counts)]
    torch.stack(losses).sum().backward()
    assert x.grad is not None and y.grad is not None and t.grad is not None and b.grad is not None
    return [float(v.detach()) for v in losses], x.grad, y.grad, float(t.grad), float(b.grad)


def check(rank: int, world: int, exchange: str, tile: int | None, micro_batches: int, uneven: bool) -> None:
    with mdist.using(mdist.Collectives(uneven_rows=uneven)):
        check_exchange(rank, world, exchange, tile, micro_batches, uneven)


def check_exchange(rank: int, world: int, exchange: str, tile: int | None, micro_batches: int, uneven: bool) -> None:
    images, texts, counts = global_batch(world, micro_batches, uneven)
    losses, grad_x, grad_y, grad_t, grad_b = paper_loss(images, texts, counts)
    start, n = sum(counts[:rank]), counts[rank]
    mine_x, mine_y = images[start : start + n], texts[start : start + n]
    scale = torch.tensor([SCALE], requires_grad=True)
    bias = torch.tensor([BIAS], requires_grad=True)
    loss = SigmoidLoss(exchange, tile)  # type: ignore[arg-type]
    grads_x, grads_y = torch.zeros_like(mine_x), torch.zeros_like(mine_y)
    rows = n // micro_batches
    if micro_batches == 1:
        x, y = mine_x.clone().requires_grad_(), mine_y.clone().requires_grad_()
        value = loss(x, y, scale, bias)
        value.backward()
        assert x.grad is not None and y.grad is not None
        grads_x, grads_y, values = x.grad, y.grad, [float(value)]
    else:
        pool = loss.pool(list(mine_x.split(rows)), list(mine_y.split(rows)))
        values = []
        for slot in range(micro_batches):
            part = slice(slot * rows, (slot + 1) * rows)
            x, y = mine_x[part].clone().requires_grad_(), mine_y[part].clone().requires_grad_()
            value = loss(x, y, scale, bias, pool=pool, slot=slot)
            value.backward()
            assert x.grad is not None and y.grad is not None
            grads_x[part], grads_y[part] = x.grad, y.grad
            values.append(float(value))
    assert scale.grad is not None and bias.grad is not None
    scale_grad, bias_grad = scale.grad.clone(), bias.grad.clone()
    if world > 1:
        dist.all_reduce(scale_grad)
        dist.all_reduce(bias_grad)
    case = f"{exchange}, tile {tile}, {micro_batches} micro-batches, uneven {uneven}"
    for value in values:
        assert value == pytest.approx(losses[rank], rel=1e-6), case
    torch.testing.assert_close(grads_x.double(), grad_x[start : start + n], rtol=1e-6, atol=1e-6, msg=case)
    torch.testing.assert_close(grads_y.double(), grad_y[start : start + n], rtol=1e-6, atol=1e-6, msg=case)
    assert float(scale_grad) == pytest.approx(grad_t, rel=1e-6, abs=1e-6), case
    assert float(bias_grad) == pytest.approx(grad_b, rel=1e-6, abs=1e-6), case


CASES = list(itertools.product(EXCHANGES, (None, 2), (1, 3), (False, True)))


def test_one_rank_equals_the_paper_formula():
    for exchange, tile, micro_batches, _ in CASES:
        check(0, 1, exchange, tile, micro_batches, False)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_the_paper_formula_on_the_whole_batch(world):
    run_on_gloo_ranks(__name__, [("check", (world, *case)) for case in CASES], world)


def test_tiled_backward_holds_no_more_than_a_tile_of_logits():
    """The tiled loss saves only its inputs for backward: nothing of rows x columns size."""
    images, texts = torch.randn(64, DIM, requires_grad=True), torch.randn(64, DIM, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        SigmoidLoss(tile_size=8)(images, texts, torch.ones(1, requires_grad=True), torch.zeros(1, requires_grad=True))
    assert saved and max(saved) <= 64 * DIM


def test_settings_are_checked():
    with pytest.raises(ValueError, match="tile_size"):
        SigmoidLoss(tile_size=0)
    with pytest.raises(ValueError, match="exchange"):
        SigmoidLoss("all_to_all")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["clip", "open_clip"])
def test_a_tile_size_of_zero_is_a_config_error_naming_the_key(method):
    from mmpt.config import ConfigError
    from mmpt.config_loader import validate_config

    section = {"name": method, "loss": {"name": "sigmoid", "tile_size": 0}}
    section.update({"tokenizer": "t.json"} if method == "clip" else {"model": "ViT-B-32"})
    with pytest.raises(ConfigError, match=r"method\.loss\.(sigmoid\.)?tile_size"):
        validate_config({"method": section, "data": {"train": {"sources": [{"shards": "x.tar"}]}}})
