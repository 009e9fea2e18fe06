"""A tiny BERT-style sequence classifier as a user brings one: a transformers config with
seeded weights, saved with save_pretrained (the user-model tests add it to a repository)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_bert(folder: Path, layers: int, labels: int) -> None:
    """A BertForSequenceClassification (vocabulary 100, width 32, 2 heads) with `layers`
    layers and `labels` classes, its weights from torch seed 0, saved into `folder`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    config.num_labels = labels
    BertForSequenceClassification(config).save_pretrained(folder)
