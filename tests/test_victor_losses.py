"""VICTOR's proxy tasks against independent (float64, loop-by-loop) computations of their formulas,
permutation labels against the shuffle actually applied, the memory queue's FIFO order on 1 and 2
ranks, and the momentum copy's update rule."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import run_on_gloo_ranks
from mmpt.engine.precision import compute_in, match_buffer_precision
from mmpt.losses.memory_queue import MemoryQueue
from mmpt.losses.mlm import masked_lm_loss
from mmpt.losses.victor import (
    IGNORE,
    PERMUTATIONS,
    dual_vsa_loss,
    inter_mfm_loss,
    intra_mfm_loss,
    mask_frames,
    mask_tokens,
    order_loss,
    permute_frames,
    permute_sentences,
    queue_nce,
    segment_order,
)
from mmpt.models.momentum import MomentumCopy


def unit(rows, dim, seed):
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def nll(logits, target):
    logits = np.asarray(logits, dtype=np.float64)
    return float(np.log(np.exp(logits).sum()) - logits[target])


def test_queue_nce_on_a_hand_computed_case():
    # q = k = e1, one negative e2, temperature 1: -log(e / (e + 1)) = log(1 + 1/e)
    q = torch.tensor([[1.0, 0.0]])
    loss = queue_nce(q, q.clone(), torch.tensor([[0.0, 1.0]]), 1.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), rel=1e-6)
    # an empty queue leaves only the positive: loss 0
    assert queue_nce(q, q.clone(), torch.zeros(0, 2), 1.0).item() == pytest.approx(0.0, abs=1e-7)


def test_dual_vsa_matches_a_loop_over_both_directions():
    video, text, video_keys, text_keys = (unit(4, 8, s).float() for s in range(4))
    text_queue, video_queue = unit(5, 8, 10).float(), unit(6, 8, 11).float()
    scale = 1 / 0.07
    expected = []
    for queries, keys, queue in ((video, text_keys, text_queue), (text, video_keys, video_queue)):
        per = [
            nll([cos(queries[i], keys[i]) * scale] + [cos(queries[i], n) * scale for n in queue], 0)
            for i in range(len(queries))
        ]
        expected.append(np.mean(per))
    loss = dual_vsa_loss(video, text, video_keys, text_keys, text_queue, video_queue, scale)
    assert loss.item() == pytest.approx(0.5 * sum(expected), rel=1e-5)


def test_intra_mfm_contrasts_each_masked_step_with_the_clips_own_frames():
    g = torch.Generator().manual_seed(0)
    outputs, inputs = torch.randn(3, 6, 5, generator=g), torch.randn(3, 6, 5, generator=g)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 1] = mask[1, 0] = mask[1, 5] = mask[2, 3] = True
    tau = 0.1
    expected = [nll([cos(outputs[b, t], inputs[b, s]) / tau for s in range(6)], t) for b, t in mask.nonzero().tolist()]
    assert intra_mfm_loss(outputs, inputs, mask, tau).item() == pytest.approx(np.mean(expected), rel=1e-5)


def test_inter_mfm_uses_the_key_frame_at_t_and_the_frames_queue():
    g = torch.Generator().manual_seed(1)
    outputs, keys, queue = (
        torch.randn(2, 4, 3, generator=g),
        torch.randn(2, 4, 3, generator=g),
        torch.randn(7, 3, generator=g),
    )
    mask = torch.tensor([[True, False, False, True], [False, True, False, False]])
    tau = 0.2
    expected = [
        nll([cos(outputs[b, t], keys[b, t]) / tau] + [cos(outputs[b, t], n) / tau for n in queue], 0)
        for b, t in mask.nonzero().tolist()
    ]
    assert inter_mfm_loss(outputs, keys, mask, queue, tau).item() == pytest.approx(np.mean(expected), rel=1e-5)


def test_order_and_mlm_losses_are_plain_cross_entropy():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0, 0.0, 0.0]])
    labels = torch.tensor([5, 2])
    assert order_loss(logits, labels).item() == pytest.approx(np.mean([nll(logits[0], 5), nll(logits[1], 2)]), rel=1e-6)
    token_logits = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2))
    token_labels = torch.tensor([[IGNORE, 1, IGNORE], [3, IGNORE, IGNORE]])
    expected = np.mean([nll(token_logits[0, 1], 1), nll(token_logits[1, 0], 3)])
    chosen = token_labels != IGNORE  # as the training step selects the masked positions before the head
    assert masked_lm_loss(token_logits[chosen], token_labels[chosen]).item() == pytest.approx(expected, rel=1e-6)
    assert masked_lm_loss(token_logits[:0, 0], token_labels[:0, 0]).item() == 0.0


@pytest.mark.parametrize("steps", [6, 8, 16])
def test_frame_permutation_labels_match_the_applied_shuffle(steps):
    frames = torch.arange(steps).repeat(len(PERMUTATIONS), 1)[..., None].expand(-1, -1, 2).float()
    labels = torch.arange(len(PERMUTATIONS))
    shuffled = permute_frames(frames, labels)
    bounds = [i * steps // 3 for i in range(4)]  # the three contiguous thirds of the clip
    for row, label in enumerate(labels.tolist()):
        order = shuffled[row, :, 0].long().tolist()
        where = {value: position for position, value in enumerate(order)}
        for s in range(3):  # each third stays contiguous and in its own order
            positions = [where[v] for v in range(bounds[s], bounds[s + 1])]
            assert positions == list(range(positions[0], positions[0] + len(positions)))
        placed = sorted(range(3), key=lambda s: where[bounds[s]])  # which third came first, second, third
        assert tuple(placed) == PERMUTATIONS[label], (label, order)
        assert shuffled[row, :, 1].long().tolist() == order  # every feature of a step moves with it


def test_sentence_permutation_keeps_cls_sep_and_padding_and_moves_labels_along():
    ids = torch.tensor([[101, 10, 11, 12, 13, 14, 15, 102, 0, 0], [101, 20, 21, 22, 102, 0, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    labels = torch.where(ids >= 10, ids + 1000, torch.full_like(ids, IGNORE))
    labels[ids >= 100] = IGNORE
    perms = torch.tensor([5, 3])  # (2, 1, 0) and (1, 2, 0)
    shuffled, moved = permute_sentences(ids, mask, perms, labels)
    assert shuffled[0].tolist() == [101, 14, 15, 12, 13, 10, 11, 102, 0, 0]
    assert shuffled[1].tolist() == [101, 21, 22, 20, 102, 0, 0, 0, 0, 0]
    assert PERMUTATIONS[5] == (2, 1, 0) and PERMUTATIONS[3] == (1, 2, 0)
    assert torch.equal(moved[moved != IGNORE], shuffled[moved != IGNORE] + 1000)


def test_sentence_permutation_equals_a_per_row_reordering():
    """Every length (no inner token up to a full row) and permutation, against `segment_order` row by row."""
    width = 12
    lengths = torch.arange(0, width + 1).repeat_interleave(len(PERMUTATIONS))
    perms = torch.arange(len(PERMUTATIONS)).repeat(width + 1)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.arange(width).repeat(len(lengths), 1) * mask
    (shuffled,) = permute_sentences(ids, mask, perms)
    for row, (length, perm) in enumerate(zip(lengths.tolist(), perms.tolist())):
        inner = max(0, length - 2)
        expected = list(range(width))
        expected[1 : 1 + inner] = [1 + i for i in segment_order(inner, PERMUTATIONS[perm])]
        assert shuffled[row].tolist() == [ids[row, i].item() for i in expected], (length, perm)


def test_token_masking_follows_bert_proportions_and_spares_special_tokens():
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (400, 64))
    ids[:, 0], lengths = 2, torch.randint(10, 64, (400,))
    mask = (torch.arange(64)[None] < lengths[:, None]).long()
    ids[torch.arange(400), lengths - 1] = 3
    ids[mask == 0] = 0
    masked, labels = mask_tokens(ids, mask, mask_id=4, vocab_size=1000)
    chosen = labels != IGNORE
    candidates = (mask.sum() - 2 * 400).item()
    assert chosen.sum().item() / candidates == pytest.approx(0.15, abs=0.01)
    assert not chosen[:, 0].any() and not chosen[torch.arange(400), lengths - 1].any() and not chosen[mask == 0].any()
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(masked[~chosen], ids[~chosen])
    as_mask = (masked[chosen] == 4).float().mean().item()
    kept = (masked[chosen] == ids[chosen]).float().mean().item()
    assert as_mask == pytest.approx(0.8, abs=0.02) and kept == pytest.approx(0.1 + 0.1 / 1000, abs=0.02)


def test_frame_masks_have_the_asked_count_per_clip():
    mask = mask_frames(50, 8, 0.25)
    assert mask.sum(1).tolist() == [2] * 50
    assert mask_frames(4, 8, 0.01).sum(1).tolist() == [1] * 4  # at least one


def test_queue_is_fifo_and_wraps():
    queue = MemoryQueue(5, 2)
    assert queue.contents().shape == (0, 2)
    for start in (0, 3, 6):
        queue.push(torch.arange(start, start + 3).float()[:, None].repeat(1, 2))
    # 9 rows written into 5 slots: the last 5 (4..8) remain, slot = row index mod 5 (as a checkpoint holds them)
    state = queue.state_dict()
    assert state["entries"][:, 0].tolist() == [5, 6, 7, 8, 4]
    assert int(state["count"]) == 5 and int(state["position"]) == 9 % 5
    assert sorted(queue.contents()[:, 0].tolist()) == [4, 5, 6, 7, 8]
    queue.push(torch.arange(100, 107).float()[:, None].repeat(1, 2))  # more than the queue holds
    assert sorted(queue.contents()[:, 0].tolist()) == [102, 103, 104, 105, 106]


def test_queue_contents_are_a_view_that_a_loss_reads_until_its_backward():
    queue = MemoryQueue(4, 2)
    queue.push(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    negatives = queue.contents()
    assert negatives.data_ptr() == queue.entries.data_ptr()  # no copy per step
    query = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss = (query @ negatives.T).sum()
    queue.push(torch.tensor([[5.0, 5.0], [7.0, 7.0]]))  # this step's keys, enqueued before its backward
    loss.backward()  # would fail had the push written into the entries the loss saved
    assert query.grad.tolist() == [[1.0, 2.0]]
    assert queue.contents().tolist() == [[1.0, 0.0], [0.0, 2.0], [5.0, 5.0], [7.0, 7.0]]


def test_queue_pointers_come_back_with_its_state():
    saved = MemoryQueue(5, 2)
    saved.push(torch.ones(3, 2))
    restored = MemoryQueue(5, 2)
    restored.push(torch.zeros(1, 2))
    restored.load_state_dict(saved.state_dict())  # as a checkpoint load does
    restored.push(torch.full((3, 2), 2.0))  # continues after the saved entries: slots 3, 4, 0
    state = restored.state_dict()
    assert state["entries"][:, 0].tolist() == [2, 1, 1, 2, 2]
    assert int(state["count"]) == 5 and int(state["position"]) == 1


def test_a_queue_whose_buffers_alone_are_restored_continues_where_it_was_saved():
    from mmpt.engine.checkpoint.deepspeed_io import restore_buffers  # what a resume on another number of ranks does

    saved = torch.nn.ModuleDict({"queue": MemoryQueue(5, 2), "head": torch.nn.Linear(2, 2)})
    saved["queue"].push(torch.ones(3, 2))
    restored = torch.nn.ModuleDict({"queue": MemoryQueue(5, 2), "head": torch.nn.Linear(2, 2)})
    weight = restored["head"].weight.detach().clone()
    restore_buffers(restored, saved.state_dict())
    restored["queue"].push(torch.full((3, 2), 2.0))  # slots 3, 4, 0, as after the saved entries
    assert restored["queue"].state_dict()["entries"][:, 0].tolist() == [2, 1, 1, 2, 2]
    assert torch.equal(restored["head"].weight, weight)  # parameters are the universal checkpoint's business


def queue_on_ranks(rank, size):
    queue = MemoryQueue(size, 3)
    for step in range(3):
        queue.push(torch.full((2, 3), float(10 * step + rank)))
    # every rank holds the same entries: step by step, rank 0's keys then rank 1's, oldest overwritten
    written = [float(10 * step + r) for step in range(3) for r in (0, 1) for _ in range(2)]
    expected = [None] * size
    for index, value in enumerate(written):
        expected[index % size] = value
    state = queue.state_dict()
    assert state["entries"][:, 0].tolist() == expected, (rank, state["entries"][:, 0].tolist(), expected)
    assert int(state["count"]) == size


def test_queue_enqueues_every_ranks_keys_in_rank_order_on_two_ranks():
    run_on_gloo_ranks(__name__, [("queue_on_ranks", (8,))], world=2)


def test_momentum_copy_moves_by_one_minus_m_and_keeps_fp32():
    source = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    key = MomentumCopy(source, momentum=0.9)
    assert not list(key.parameters()) and all(not b.requires_grad for b in key.buffers())
    before = {k: v.clone() for k, v in key.network.state_dict().items()}
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    source.train()(torch.randn(5, 3))  # moves the BatchNorm statistics (and its counter)
    key.update()
    for name, value in source.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(key.network.state_dict()[name], 0.9 * before[name] + 0.1 * value, atol=1e-6), name
        else:
            assert torch.equal(key.network.state_dict()[name], value), name
    # a bf16 run, set up by the engine's precision helpers as for VICTOR's declared fp32 key network:
    # the copy's weights stay fp32, it takes and answers tensors in the training precision
    inputs = torch.randn(5, 3)
    reference = key.eval()(inputs)
    both = nn.ModuleDict({"source": source, "key": key}).bfloat16()  # the cast DeepSpeed gives a bf16 module
    match_buffer_precision(both, torch.bfloat16, fp32_modules=(key,))
    compute_in((key,), torch.bfloat16, "cpu")
    low = key(inputs.bfloat16())
    assert low.dtype == torch.bfloat16 and key.network[0].weight.dtype == torch.float32
    assert source[1].running_mean.dtype == torch.bfloat16  # everything else takes the training precision
    assert torch.allclose(low.float(), reference, atol=0.1)
