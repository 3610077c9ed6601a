"""SPACE-2's soft SupCon loss against a literal float64 transcription of its formula (spec §4.2), alone and on
2 ranks."""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tree_score_reference import view_score_matrices

from conftest import run_on_gloo_ranks
from mmpt.losses.mlm import masked_lm_loss
from mmpt.losses.tree_contrastive import TreeContrastiveLoss
from mmpt.losses.tree_score import VIEWS

TAU = 0.07


def reference_view_loss(features: torch.Tensor, weights: torch.Tensor, tau: float = TAU, tau_base: float = 0.07):
    """The spec's steps one by one, with Python loops: F [N, 2, d] (normalised), W [N, N]."""
    n = features.shape[0]
    z = [features[r, 0] if r < n else features[r - n, 1] for r in range(2 * n)]
    total = 0.0
    for r in range(2 * n):
        logits = [torch.dot(z[r], z[c]) / tau for c in range(2 * n)]
        log_norm = torch.logsumexp(torch.stack([logits[a] for a in range(2 * n) if a != r]), 0)
        weighted, weight_sum = 0.0, 0.0
        for c in range(2 * n):
            if c == r:
                continue
            w = weights[r % n, c % n]
            weighted = weighted + w * (logits[c] - log_norm)
            weight_sum = weight_sum + w
        total = total - (tau / tau_base) * weighted / weight_sum
    return total / (2 * n)


def random_frame(rng: random.Random) -> dict:
    if rng.random() < 0.2:
        return {}
    domain = rng.choice(["hotel", "taxi", "DEFAULT_DOMAIN"])
    intent = rng.choice(["inform", "request", "book"])
    slots = {
        s: [{"value": rng.choice(["north", "cheap", "4"]), "span": None}]
        for s in rng.sample(["area", "price", "stars"], rng.randint(1, 2))
    }
    return {domain: {intent: slots}}


def features_and_labels(n: int, views: int, dim: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 2, views, dim, generator=generator, dtype=torch.float64)
    rng = random.Random(seed)
    return features, [random_frame(rng) for _ in range(n)]


def test_matches_the_formula_value_and_gradient():
    features, labels = features_and_labels(5, views=3)
    views = [1, 3, 9]
    leaf = features.clone().requires_grad_(True)
    loss = TreeContrastiveLoss(views, temperature=TAU)(leaf, labels)
    (grad,) = torch.autograd.grad(loss, leaf)

    ref_leaf = features.clone().requires_grad_(True)
    normed = F.normalize(ref_leaf, dim=-1)
    weights = view_score_matrices(labels, labels, views=views).double()
    reference = sum(reference_view_loss(normed[:, :, k], weights[k]) for k in range(3)) / 3
    (ref_grad,) = torch.autograd.grad(reference, ref_leaf)
    torch.testing.assert_close(loss.double(), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=1e-4)


def test_temperature_rescales_against_fixed_base():
    features, labels = features_and_labels(4, views=1)
    normed = F.normalize(features, dim=-1)
    weights = view_score_matrices(labels, labels, views=[0]).double()
    loss = TreeContrastiveLoss([0], temperature=0.2)(features, labels)
    torch.testing.assert_close(
        loss.double(), reference_view_loss(normed[:, :, 0], weights[0], tau=0.2), atol=1e-5, rtol=1e-5
    )


def test_identity_scores_give_the_self_supervised_loss():
    """Empty labels score 0 off the diagonal: only the other dropout copy is positive (SimCSE/NT-Xent)."""
    features, _ = features_and_labels(6, views=2)
    loss = TreeContrastiveLoss([0, 5])(features, [{}] * 6)
    expected = 0.0
    for k in range(2):
        z = F.normalize(torch.cat([features[:, 0, k], features[:, 1, k]]), dim=-1)
        logits = (z @ z.T / TAU).fill_diagonal_(float("-inf"))
        targets = torch.cat([torch.arange(6, 12), torch.arange(0, 6)])
        expected += F.cross_entropy(logits, targets) / 2
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=1e-5)


def test_combined_score_uses_one_feature():
    with pytest.raises(ValueError, match="exactly one"):
        TreeContrastiveLoss([0, 1], combined=True)
    features, labels = features_and_labels(4, views=1)
    assert torch.isfinite(TreeContrastiveLoss([0], combined=True)(features, labels))


def test_masked_lm_loss_is_token_mean_and_zero_without_targets():
    logits = torch.randn(4, 11)
    targets = torch.tensor([1, 2, 3, 10])
    torch.testing.assert_close(masked_lm_loss(logits, targets), F.cross_entropy(logits, targets))
    assert masked_lm_loss(logits[:0], targets[:0]).item() == 0.0


# ----------------------------------------------------------------------------- 2 ranks

WORLD, LOCAL = 2, 3


def check_global_batch(rank):
    """Each rank's local loss over gathered columns averages to the global batch's loss; gradients match."""
    views = list(range(len(VIEWS)))
    features, labels = features_and_labels(WORLD * LOCAL, views=len(views), seed=11)
    features = features.float()
    rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
    leaf = features[rows].clone().requires_grad_(True)
    loss = TreeContrastiveLoss(views)(leaf, labels[rows])
    (grad,) = torch.autograd.grad(loss, leaf)  # includes the other rank's loss through the gather's backward
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= WORLD

    ref_leaf = features.double().clone().requires_grad_(True)
    normed = F.normalize(ref_leaf, dim=-1)
    weights = view_score_matrices(labels, labels).double()
    reference = sum(reference_view_loss(normed[:, :, k], weights[k]) for k in views) / len(views)
    (ref_grad,) = torch.autograd.grad(reference, ref_leaf)
    torch.testing.assert_close(mean_loss.double(), reference, atol=1e-5, rtol=1e-5)
    # the engine averages rank gradients: (sum of both ranks' loss gradients) / WORLD = d(global loss)
    torch.testing.assert_close(grad.double() / WORLD, ref_grad[rows], atol=1e-5, rtol=1e-4)


def test_loss_over_two_gloo_ranks_equals_the_global_batch():
    run_on_gloo_ranks(__name__, [("check_global_batch", ())], WORLD)
