"""A training step of every method dispatches no op that would make the host wait for a GPU.

Each registered method is built at its `tiny_overrides` size in this process (a world of one), reads one
batch of its demo data, and runs one step on it: its `training_step` (with the step pool first when it
pools micro-batches, over two of them) and the backward of the summed loss terms. The step runs under
`host_syncs.HostSyncs`, which checks every aten op dispatched, by mmpt's code and the timm, transformers
and torch code it calls, forward and backward, against the ops whose CUDA kernels read a value back to
the host (`.item()`, boolean-mask indexing, `nonzero`, ...). Reading the batch is outside the count: what
is counted is the work on the device. Each op found is named with the line that asked for it.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from host_syncs import HostSyncs
from test_config_matrix import shrink
from test_every_method import demo_config

from mmpt.methods import list_methods
from mmpt.methods.base import loss_terms


def first_batches(method, cfg, run_dir, count: int) -> list[dict]:
    from mmpt.data.loader import StatefulLoader

    batches = iter(StatefulLoader(method.train_data(cfg, run_dir, rank=0, world_size=1)))
    return [next(batches) for _ in range(count)]


def one_step(method, cfg, model, loss, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
    """What the engine runs of a step on the device: the pool pass when the method pools micro-batches, then
    each micro-batch's `training_step` and the backward of its summed terms. Returns the last terms."""
    needs = method.engine_needs(model, cfg)
    pool = None
    if needs.step_pool is not None:
        with torch.no_grad():
            pool = needs.pool(model, loss, micro_batches)
    terms = {}
    for index, batch in enumerate(micro_batches):
        terms = method.training_step(model, loss, batch, pool, index)
        functools.reduce(operator.add, loss_terms(terms).values()).backward()
    return terms


@pytest.mark.parametrize("name", list_methods())
def test_training_step_has_no_host_sync(name, corpora, tmp_path):
    from mmpt.config_loader import load_config
    from mmpt.methods import get_method

    config = demo_config(name)
    run_dir = tmp_path / "run"
    cfg = load_config(config, [*shrink(config, corpora), "data.train.num_workers=0", f"run.output_dir={run_dir}"])
    method = get_method(name)
    run_dir.mkdir()
    method.prepare(cfg, run_dir)
    torch.manual_seed(0)
    model = method.build_model(cfg, run_dir).train()
    loss = method.build_loss(cfg)
    per_step = 2 if method.engine_needs(model, cfg).step_pool is not None else 1
    batches = first_batches(method, cfg, run_dir, 2 * per_step)

    # The first step makes what is made once per process (constants cached per device); the second is counted.
    one_step(method, cfg, model, loss, batches[:per_step])
    model.zero_grad()
    with HostSyncs() as seen:
        terms = one_step(method, cfg, model, loss, batches[per_step:])

    assert terms, "the step returned no loss term"
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads), "the step's backward reached no parameter"
    assert not seen.found, f"{name}: ops that wait for the device:\n" + "\n".join(
        f"  {count} x {op}" for op, count in sorted(seen.found.items())
    )


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [True, False])
def test_prepared_padding_mask_gives_what_the_2d_mask_gives(implementation, padded):
    """The 4-D mask the towers hand to BERT (no host read) changes neither its outputs nor their gradients."""
    from transformers import BertConfig, BertModel

    from mmpt.models.padding_masks import last_hidden_state

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config._attn_implementation = implementation
    encoder = BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(1, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    if padded:
        mask[0, 4:] = 0
        mask[2, 2:] = 0
    weights = torch.randn(3, 7, 16)

    def outputs_and_grads(run):
        encoder.zero_grad()
        hidden = run()
        (hidden * weights * mask[..., None]).sum().backward()
        return hidden.detach(), [p.grad.clone() for p in encoder.parameters() if p.grad is not None]

    ours, our_grads = outputs_and_grads(lambda: last_hidden_state(encoder, ids, mask))
    theirs, their_grads = outputs_and_grads(lambda: encoder(input_ids=ids, attention_mask=mask).last_hidden_state)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-6, atol=1e-6)
    assert len(our_grads) == len(their_grads)
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_masked_sums_equal_the_boolean_selections_they_replace():
    """VICTOR's frame and token losses as masked sums over every position: the values and gradients of the
    former formulation (select with the boolean mask, then average), with the mask's count left on the device."""
    import torch.nn.functional as F

    from mmpt.losses.mlm import IGNORE, masked_lm_loss
    from mmpt.losses.victor import inter_mfm_loss, intra_mfm_loss, mask_frames, queue_nce

    torch.manual_seed(0)
    batch, steps, dim, temperature = 3, 6, 8, 0.07
    outputs = torch.randn(batch, steps, dim, requires_grad=True)
    frames = torch.randn(batch, steps, dim, requires_grad=True)
    keys, queue = torch.randn(batch, steps, dim), torch.randn(10, dim)
    frame_mask = mask_frames(batch, steps, 0.34, "cpu")
    frame_mask[1, 0] = True  # rows with different counts too

    def old_intra():
        out, inputs = F.normalize(outputs, dim=-1), F.normalize(frames, dim=-1)
        logits = out @ inputs.transpose(1, 2) / temperature
        return F.cross_entropy(logits[frame_mask], torch.arange(steps).expand(batch, -1)[frame_mask])

    def old_inter():
        out, key = F.normalize(outputs[frame_mask], dim=-1), F.normalize(keys[frame_mask], dim=-1)
        return queue_nce(out, key, F.normalize(queue, dim=-1), 1.0 / temperature)

    vocab = 11
    token_logits = torch.randn(batch, steps, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, steps))
    chosen = torch.rand(batch, steps) < 0.4
    labels = torch.where(chosen, labels, IGNORE)
    pairs = [
        (lambda: intra_mfm_loss(outputs, frames, frame_mask, temperature), old_intra),
        (lambda: inter_mfm_loss(outputs, keys, frame_mask, queue, temperature), old_inter),
        (lambda: masked_lm_loss(token_logits, labels), lambda: F.cross_entropy(token_logits[chosen], labels[chosen])),
    ]
    leaves = (outputs, frames, token_logits)
    for new, old in pairs:
        expected = old()
        expected_grads = torch.autograd.grad(expected, leaves, allow_unused=True, materialize_grads=True)
        value = new()
        grads = torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
        for a, b in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    nothing = torch.full_like(labels, IGNORE)
    empty = masked_lm_loss(token_logits, nothing)
    assert float(empty.detach()) == 0.0
    (grad,) = torch.autograd.grad(empty, token_logits)
    assert not grad.any()


def test_space2_mlm_reads_the_positions_the_collate_step_found():
    """SPACE-2's MLM logits and targets at `mlm_positions` (found when batches are collated) are those its
    boolean mask of predicted tokens selects, in the same order."""
    from transformers import BertConfig

    from mmpt.data.dialog_encoding import collate_dialogs
    from mmpt.models.space2 import Space2Encoder

    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = Space2Encoder(config, views=2, subspace_dim=4, dropout=0.0).eval()
    examples = []
    for length in (5, 9, 3):
        ids = torch.randint(1, 40, (length,))
        labels = torch.where(torch.rand(length) < 0.4, ids, 0)
        fields = {"positions": torch.arange(length), "turns": torch.ones(length, dtype=torch.long)}
        examples.append({"input_ids": ids, "mlm_input_ids": ids, "mlm_labels": labels, "roles": ids % 2, **fields})
    batch = collate_dialogs(examples)
    logits, targets = model.mlm_logits(batch)

    predicted = batch["mlm_labels"] != 0
    assert int(predicted.sum()) > 0
    embedded = model._embed(batch["mlm_input_ids"], batch["positions"], batch["roles"], batch["turns"])
    states = model._encode(embedded, batch["attention_mask"])
    torch.testing.assert_close(logits, model.mlm_head(states[predicted]), rtol=0, atol=0)
    assert torch.equal(targets, batch["mlm_labels"][predicted])
