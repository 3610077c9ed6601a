"""Ulysses sequence parallelism (mmpt/engine/sequence_parallel.py) on 2 gloo ranks against one process on the
whole sequence: outputs, and gradients averaged over the ranks as DeepSpeed averages them, for VICTOR's
transformer with a layer before it (whose output also reaches the loss directly) and a head after it."""

import os

import pytest
import torch
from torch import nn

from conftest import run_on_gloo_ranks


class Model(nn.Module):
    def __init__(self, heads: int):
        super().__init__()
        from mmpt.models.victor import Transformer

        self.before = nn.Linear(6, 12)
        self.transformer = Transformer(12, layers=2, heads=heads)
        self.after = nn.Linear(12, 3)

    def forward(self, x, padding):
        tokens = self.before(x)
        out = self.after(self.transformer(tokens, padding))
        return out.square().mean() + 0.1 * tokens[:, 0].sin().sum()


def inputs(length: int, with_padding: bool):
    generator = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, 6, generator=generator)
    padding = None
    if with_padding:
        padding = torch.zeros(3, length, dtype=torch.bool)
        padding[1, length - 2 :] = True
        padding[2, 1] = True
    return x, padding


def check_split_sequence_matches_whole(rank, heads, length, with_padding):
    import deepspeed
    import torch.distributed as dist

    from mmpt.engine.sequence_parallel import split_sequences

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    whole = Model(heads)
    split = Model(heads)
    split.load_state_dict(whole.state_dict())
    split_sequences([split.transformer], dist.new_group([0, 1]), 2)
    x, padding = inputs(length, with_padding)

    expected = whole(x, padding)
    expected.backward()
    loss = split(x, padding)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # DeepSpeed's average over the 2 ranks
        torch.testing.assert_close(grad / 2, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_split_sequence_matches_the_whole_sequence():
    """Odd and even lengths, with and without padding, 2 and 4 heads (one start of 2 ranks for all)."""
    cases = [(4, 9, False), (4, 8, True), (2, 7, True)]
    run_on_gloo_ranks(__name__, [("check_split_sequence_matches_whole", case) for case in cases], 2)


def test_heads_must_divide_among_the_ranks():
    from mmpt.config import ConfigError
    from mmpt.engine.sequence_parallel import split_sequences
    from mmpt.models.victor import Transformer

    with pytest.raises(
        ConfigError,
        match=r"'train.sequence_parallel': 2 ranks share out attention heads evenly, but "
        r"Transformer has 3 heads",
    ):
        split_sequences([Transformer(12, layers=1, heads=3)], None, 2)
    with pytest.raises(ConfigError, match="Linear has no timm Attention"):
        split_sequences([nn.Linear(2, 2)], None, 2)


def check_victor_step_matches_whole(rank, tokenizer_path, run_dir):
    import deepspeed
    import torch.distributed as dist

    from mmpt.engine.sequence_parallel import split_sequences
    from mmpt.methods import get_method
    from mmpt.release import model_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = model_config(
        {
            "name": "victor",
            "tokenizer": tokenizer_path,
            "embed_dim": 16,
            "cross_layers": 1,
            "queue_size": 32,
            "frame_queue_size": 64,
            "momentum": 0.5,
            "video": {"backbone": None, "feature_dim": 20, "num_frames": 6, "width": 32, "layers": 2, "heads": 2},
            "text": {"width": 32, "layers": 1, "heads": 2, "context_length": 16},
        }
    )
    method = get_method("victor")
    if rank == 0:
        method.prepare(cfg, run_dir)
    dist.barrier()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append((method.build_model(cfg, run_dir).train(), method.build_loss(cfg)))
    (whole, whole_loss), (split, split_loss) = models
    split_sequences(method.engine_needs(split, cfg).sequence_parallel, dist.new_group([0, 1]), 2)
    tokens = method.tokenizer(cfg, run_dir)(
        [
            "the digit seven moves to the left.",
            "数字三向上移动。",
            "first a one appears, then a two.",
            "the digit five moves down.",
        ]
    )
    batch = {"frame_features": torch.randn(4, 6, 20, generator=torch.Generator().manual_seed(3)), **tokens}
    results = []
    for model, loss in models:
        torch.manual_seed(1)  # the same token and frame masks, sentence and frame orders
        terms = method.training_step(model, loss, batch)
        sum(terms.values()).backward()
        results.append(terms)
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            # 1e-5 of the tensor's largest element: a gradient summed over every token (the token-type embedding)
            # adds its terms in another order when the tokens are split; key biases, whose gradient is 0 but for
            # rounding, get a floor
            atol = 1e-5 * q.grad.abs().max().item() + 1e-8
            torch.testing.assert_close(grad / 2, q.grad, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def test_victor_step_with_split_sequences_matches_the_whole_one(moving_digits_root, tmp_path):
    """Every task of VICTOR's step (temporal, cross-modal and key transformers split) against the whole step."""
    run_on_gloo_ranks(
        __name__, [("check_victor_step_matches_whole", (str(moving_digits_root / "tokenizer.json"), tmp_path))], 2
    )


def test_sequence_parallel_must_divide_the_ranks():
    from mmpt import distributed as mdist
    from mmpt.config import ConfigError

    with pytest.raises(ConfigError, match=r"'train.sequence_parallel': 2 must divide the 1 ranks"):
        mdist.set_sequence_parallel(2)
    assert mdist.set_sequence_parallel(1).data_size == 1
