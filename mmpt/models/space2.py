"""SPACE-2's dialog encoder on a Hugging Face BERT-family backbone (spec §3, §5.5, §6.2).

The transformer layers, word/position/type embeddings and their LayerNorm come from any local
BERT-family checkpoint; SPACE-2 adds a turn embedding (17 rows), uses the type embedding for the
role, prepends the raw `[CLS]` word embedding (no position/type/turn) before the embedding
LayerNorm, and applies embedding dropout to the sum before that LayerNorm. The dialog vector is the
final state at that CLS position; the Subspace head projects it to one vector per tree view. MLM is
a separate pass without the CLS, through a transform + tied-decoder head.

Our design: the turn embedding starts at zero, so an HF checkpoint's embeddings are unchanged at
the start (SPACE-2 initialises from a ConvBERT checkpoint that already has one).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig
from transformers.utils import logging as hf_logging

from mmpt.models.padding_masks import prepared_padding_mask

TURN_ROWS = 17  # turn ids 1..16, 0 for padding


@contextmanager
def quiet_transformers():
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


class Subspace(nn.Module):
    """Linear(hidden -> views * dim) + tanh, reshaped to [batch, views, dim]."""

    def __init__(self, hidden: int, views: int, dim: int):
        super().__init__()
        self.views, self.dim = views, dim
        self.proj = nn.Linear(hidden, views * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)).view(x.shape[0], self.views, self.dim)


class MaskedLMHead(nn.Module):
    """Linear + GELU + LayerNorm, then a decoder whose weight is the word embedding matrix (tied).

    The tie shares the Parameter (as HF ties embeddings), and the decoder is a module of its own, so
    the shared weight is read in the forward of a module that owns it (the parameter rule).
    """

    def __init__(self, hidden: int, word_embeddings: nn.Embedding, eps: float):
        super().__init__()
        self.transform = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.decoder = nn.Linear(hidden, word_embeddings.num_embeddings)
        self.decoder.weight = word_embeddings.weight
        nn.init.zeros_(self.decoder.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.transform(hidden))))


class Space2Encoder(nn.Module):
    def __init__(
        self,
        backbone_config: PretrainedConfig,
        *,
        views: int = 10,
        subspace_dim: int | None = None,
        dropout: float | None = None,
    ):
        super().__init__()
        config = backbone_config
        if dropout is not None:
            config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
        if getattr(config, "type_vocab_size", 2) < 2:
            raise ValueError(f"the backbone has {config.type_vocab_size} token types; SPACE-2 needs 2 for the roles")
        self.config = config
        hidden = config.hidden_size
        self.backbone = AutoModel.from_config(config, add_pooling_layer=False)
        self.turn_embeddings = nn.Embedding(TURN_ROWS, hidden)
        nn.init.zeros_(self.turn_embeddings.weight)
        self.embedding_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.subspace = Subspace(hidden, views, subspace_dim or hidden)
        self.mlm_head = MaskedLMHead(hidden, self.backbone.embeddings.word_embeddings, config.layer_norm_eps)
        self.cls_token_id = config.cls_token_id if getattr(config, "cls_token_id", None) is not None else 101

    @classmethod
    def from_backbone_dir(cls, path: str, **kwargs) -> Space2Encoder:
        return cls(AutoConfig.from_pretrained(path), **kwargs)

    def load_backbone(self, path: str) -> None:
        """Weights of a local HF checkpoint into the backbone; the SPACE-2 heads keep their initialisation."""
        with quiet_transformers():  # its load report lists the pooler we drop on purpose
            pretrained = AutoModel.from_pretrained(path, add_pooling_layer=False)
        missing, unexpected = self.backbone.load_state_dict(pretrained.state_dict(), strict=False)
        relevant = [k for k in missing if not k.endswith("position_ids")]
        if relevant or unexpected:
            raise ValueError(
                f"{path}: backbone weights do not fit: missing {relevant[:5]}, unexpected {unexpected[:5]}"
            )

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings.word_embeddings

    def _embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, roles: torch.Tensor, turns: torch.Tensor
    ) -> torch.Tensor:
        emb = self.backbone.embeddings
        summed = (
            emb.word_embeddings(input_ids)
            + emb.position_embeddings(positions)
            + emb.token_type_embeddings(roles)
            + self.turn_embeddings(turns)
        )
        return self.embedding_dropout(summed)

    def _encode(self, embedded: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        embedded = self.backbone.embeddings.LayerNorm(embedded)
        mask = prepared_padding_mask(self.config, attention_mask, embedded.dtype)
        return self.backbone.encoder(embedded, attention_mask=mask).last_hidden_state

    def dialog_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Final hidden states with the CLS prepended: [batch, 1 + length, hidden]."""
        embedded = self._embed(batch["input_ids"], batch["positions"], batch["roles"], batch["turns"])
        cls_ids = torch.full_like(batch["input_ids"][:, :1], self.cls_token_id)
        embedded = torch.cat([self.word_embeddings(cls_ids), embedded], dim=1)
        mask = batch["attention_mask"].bool()
        mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
        return self._encode(embedded, mask)

    def dialog_vector(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The CLS state, SPACE-2's dialog representation."""
        return self.dialog_states(batch)[:, 0]

    def view_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-view projections [batch, views, dim] (not normalised)."""
        return self.subspace(self.dialog_vector(batch))

    def mlm_logits(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, targets) at the predicted positions of the MLM inputs only: those `mlm_positions` lists
        (`collate_dialogs` finds them on the host, so that no boolean mask sizes the logits on the device)."""
        embedded = self._embed(batch["mlm_input_ids"], batch["positions"], batch["roles"], batch["turns"])
        states = self._encode(embedded, batch["attention_mask"].bool())
        rows, columns = batch["mlm_positions"].unbind(1)
        return self.mlm_head(states[rows, columns]), batch["mlm_labels"][rows, columns]

    def encode_dialog(self, batch: dict[str, torch.Tensor], view: str | None = None) -> torch.Tensor:
        """L2-normalised dialog features: the CLS state, or one view's projection (e.g. view index of "I")."""
        if view is None:
            return F.normalize(self.dialog_vector(batch), dim=-1)
        from mmpt.losses.tree_score import VIEWS

        return F.normalize(self.view_features(batch)[:, VIEWS.index(view)], dim=-1)
