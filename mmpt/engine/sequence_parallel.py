"""Ulysses sequence parallelism (DeepSpeed-Ulysses) for the transformers a method declares.

With `train.sequence_parallel: N`, N consecutive ranks read the same samples and split the sequence of
each declared transformer: every rank runs the blocks on L/N tokens, and around each attention an
all-to-all trades the sequence split for a head split (DeepSpeed's `DistributedAttention`), so attention
sees all L tokens for H/N heads. Activations inside the transformer shrink N-fold per rank.

A declared module is called as `module(tokens [B, L, W], padding [B, L] or None)` (True: a key position to
ignore), mixes tokens only in timm `Attention` layers, and returns [B, L, W]. The engine wraps it:
- on entry, tokens are padded to a multiple of N (the padding masked as keys) and this rank keeps its slice;
- each timm `Attention` computes q, k, v on its slice and attends through the all-to-all;
- on exit, the slices are gathered back into the whole sequence.

Gradients: every rank of a sequence group computes the same loss from the gathered output, so the group
computes N copies of it. The gather's backward is a reduce-scatter (each rank gets its slice of the gradient
summed over the group), the adjoint of the gather, which stays right when a gathered output feeds another split
transformer (VICTOR's temporal output into the cross-modal one). The group's parameter gradients then sum to N
times the gradient, and DeepSpeed's average over all ranks (data x sequence) divides the N back out: a step
equals the step of a run without sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.models.vision_transformer import Attention  # pyright: ignore[reportPrivateImportUsage]
from torch import nn

from mmpt.config import ConfigError
from mmpt.distributed import all_gather_with_grad


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """Attention of [B, L, h, d] queries, keys and values (this rank's heads, every token)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, dropout_p=dropout
    )
    return out.transpose(1, 2)


class UlyssesAttention(Attention):
    """timm's `Attention` on a slice of the sequence: q, k, v for the slice, all-to-all to every token of a
    share of the heads, attention, all-to-all back; the projections run on the slice (as module calls)."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if is_causal:
            raise NotImplementedError("sequence-parallel attention is bidirectional; a causal mask is not supported")
        batch, tokens, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)
        dropout = self.attn_drop.p if self.training else 0.0
        # `ulysses` is not a registered module (see split_sequences), so the checker cannot see its call
        x = self.ulysses(q, k, v, 0, None, attn_mask, dropout)  # pyright: ignore[reportCallIssue]
        x = x.reshape(batch, tokens, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class _SplitSequence:
    """Forward hooks that make a declared transformer run on this rank's slice of the sequence."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.lengths: dict[int, list[int]] = {}  # id(module) -> lengths of the calls in flight

    def enter(self, module: nn.Module, args: tuple, kwargs: dict):
        tokens, *rest = args
        padding = rest[0] if rest else kwargs.pop("padding", None)
        length = tokens.shape[1]
        extra = -length % self.size
        if extra:
            tokens = F.pad(tokens, (0, 0, 0, extra))
            if padding is None:
                padding = torch.zeros(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
                padding[:, length:] = True
            else:
                padding = F.pad(padding, (0, extra), value=True)
        self.lengths.setdefault(id(module), []).append(length)
        # A copy, not a view: a view would keep the whole input alive until backward through what the blocks save.
        local = tokens.chunk(self.size, dim=1)[self.rank].contiguous()
        return (local, padding), kwargs

    def leave(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        length = self.lengths[id(module)].pop()
        whole = all_gather_with_grad(output.transpose(0, 1).contiguous(), self.group).transpose(0, 1)
        return whole[:, :length]


def split_sequences(modules: Sequence[nn.Module], group: dist.ProcessGroup, setting: int) -> None:
    """Make each of `modules` sequence-parallel over `group` (before DeepSpeed wraps the model)."""
    from deepspeed.sequence.layer import DistributedAttention

    for module in modules:
        attentions = [m for m in module.modules() if isinstance(m, Attention)]
        if not attentions:
            raise ConfigError(
                f"config key 'train.sequence_parallel': {type(module).__name__} has no timm Attention "
                "layer to split the sequence around"
            )
        for attention in attentions:
            if attention.num_heads % setting:
                raise ConfigError(
                    f"config key 'train.sequence_parallel': {setting} ranks share out attention heads "
                    f"evenly, but {type(module).__name__} has {attention.num_heads} heads per layer"
                )
    hooks = _SplitSequence(group)
    for module in modules:
        for attention in [m for m in module.modules() if isinstance(m, Attention)]:
            attention.__class__ = UlyssesAttention
            # not a registered submodule: it holds no state, and ZeRO-3's hooks have nothing to gather in it
            # DeepSpeed types the local attention as a module; any callable of (q, k, v, ...) is what it calls
            ulysses = DistributedAttention(_attend, group, scatter_idx=2, gather_idx=1)  # pyright: ignore[reportArgumentType]
            object.__setattr__(attention, "ulysses", ulysses)
        module.register_forward_pre_hook(hooks.enter, with_kwargs=True)
        module.register_forward_hook(hooks.leave, with_kwargs=True)
