"""Weights read one tensor at a time (`mmpt/models/tensor_files.py`, `OfficialTensors`): what a model built
partitioned is filled from. Each reader gives exactly what loading the file whole gives, with the shapes it
announces before reading, and holds only a bounded part of the file in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmpt.models.m2_encoder import PRESETS, M2Encoder, M2EncoderConfig
from mmpt.models.m2_official import DEEPSPEED_PREFIX, OfficialTensors, convert_official, read_official
from mmpt.models.tensor_files import CheckpointMismatch, MappedCheckpoint, SafetensorsTensors


def _demo(**overrides) -> M2Encoder:
    torch.manual_seed(0)
    return M2Encoder(M2EncoderConfig(**{**PRESETS["m2-encoder-demo"], "vocab_size": 300, **overrides}))


@pytest.mark.parametrize("wrapper", ["lightning", "deepspeed", "legacy format"])
def test_an_official_checkpoint_read_tensor_by_tensor_is_what_loading_it_whole_gives(tmp_path, wrapper):
    model = _demo(image_size=48)  # a 12x12 patch grid: the official 14x14 position table is fitted to it
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["logit_scale"] = torch.tensor(3.0)  # 0-D, as released
    state["backbone.encoder.embed_positions.A.weight"] = torch.randn(3 + 196, model.cfg.width)
    state["visual_tokenizer.codebook"] = torch.randn(4, 4)  # training-only, left out
    path = tmp_path / "official.ckpt"
    if wrapper == "deepspeed":
        torch.save({"module": {DEEPSPEED_PREFIX + k: v for k, v in state.items()}}, path)
    else:
        torch.save({"state_dict": state}, path, _use_new_zipfile_serialization=wrapper != "legacy format")

    whole = convert_official(read_official(path), model)
    reader = OfficialTensors(path, model.cfg.num_patches)
    assert reader.shapes() == {k: tuple(v.shape) for k, v in whole.items()}  # announced before reading
    assert "visual_tokenizer.codebook" not in reader.shapes() and reader.shapes()["logit_scale"] == (1,)
    for name, tensor in whole.items():
        assert torch.equal(reader.read(name), tensor), name
    model.load_state_dict({k: reader.read(k) for k in reader.shapes()}, strict=True)  # they fit the model


def test_a_sharded_safetensors_release_reads_across_its_shards(tmp_path):
    from huggingface_hub import save_torch_state_dict

    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    save_torch_state_dict(state, tmp_path, max_shard_size="40KB")  # model-0000x-of-0000y + index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    reader = SafetensorsTensors(tmp_path / "model.safetensors")
    assert reader.shapes() == dict.fromkeys(state, (64, 64))
    assert all(torch.equal(reader.read(k), v) for k, v in state.items())


def test_a_mapped_checkpoint_holds_a_bounded_part_of_the_file(tmp_path):
    tensors = {f"t{i}": torch.randn(1024, 1024) for i in range(64)}  # 256 MB, 4 MB each
    path = tmp_path / "big.pt"
    torch.save(tensors, path)
    del tensors
    reader = MappedCheckpoint(path, lambda obj: obj)  # type: ignore[arg-type]
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from here
    before = _status_kib("VmRSS")
    for name in reader.shapes():
        reader.read(name)
    grown = (_status_kib("VmHWM") - before) * 1024
    # The pages mapped since the last re-map, copies and what the allocator keeps of them (~55 MB measured):
    # far from the file's 256 MB, which mapping it once would leave resident.
    assert grown < 256 * 2**20 / 3, grown


def test_a_file_that_does_not_fit_is_named_with_what_differs():
    from mmpt.models.tensor_files import check_covers

    with pytest.raises(CheckpointMismatch, match=r"w.ckpt does not fit this model: missing \(1\): b; unexpected"):
        check_covers("w.ckpt", {"a": (2,), "c": (1,)}, {"a": (2,), "b": (3,)}, "this model")
    with pytest.raises(CheckpointMismatch, match=r"shape mismatch \(1\): a: checkpoint \[2\] vs model \[3\]"):
        check_covers("w.ckpt", {"a": (2,)}, {"a": (3,)}, "this model")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)
