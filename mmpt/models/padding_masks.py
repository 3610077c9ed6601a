"""Padding masks handed to Hugging Face encoders in the 4-D form they take as is.

Given a 2-D padding mask, transformers first asks whether any position is padded (`mask.all()`), so that
it can drop the mask when none is: a value read back to the host, which makes every text-encoder call of a
GPU step wait for the device. A 4-D mask is used as given, with no such question. The one built here is
what transformers would build from the 2-D mask for the same attention implementation (booleans for
SDPA, 0 / the dtype's minimum added to the scores for eager attention), broadcast over the query positions.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel


def prepared_padding_mask(config: PretrainedConfig, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] mask (nonzero / True where a token is real) -> [B, 1, 1, L] for `config`'s attention.

    Implementations that consume the 2-D mask themselves (flash attention unpads with it) get it back.
    """
    implementation = config._attn_implementation
    if attention_mask.ndim != 2 or implementation not in ("sdpa", "eager"):
        return attention_mask
    keep = attention_mask.bool()[:, None, None, :]
    if implementation == "sdpa":
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def last_hidden_state(encoder: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`encoder(input_ids, attention_mask).last_hidden_state`, with the mask prepared here (see above)."""
    eager = encoder.config._attn_implementation == "eager"  # only eager masks carry the scores' dtype
    mask = prepared_padding_mask(encoder.config, attention_mask, encoder.dtype if eager else torch.float32)
    return encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
