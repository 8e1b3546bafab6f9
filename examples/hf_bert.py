"""A Hugging Face model as it is: BertForSequenceClassification from a tiny config, dict items of synthetic tokens
with their labels, the model's own loss, variable lengths padded per batch by a collate_fn. Nothing is downloaded.

    ddp-amp spawn -n 2 --device cpu --task examples/hf_bert.py:build --steps 20
    ddp-amp spawn -n 2 --device cpu --task examples/hf_bert.py:build --task-arg layers=4 --steps 20

model.pt holds the model's own state_dict: `BertForSequenceClassification(config).load_state_dict(...)` takes it.
"""

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification

from ddp_amp.tasks import Task

VOCAB, LONGEST, CLASSES = 512, 32, 2


class SyntheticReviews(Dataset):
    """Token sequences of 8 to 32 tokens; the label is whether token 7 appears (something to learn)."""

    def __init__(self, size: int = 2048, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, LONGEST + 1, (size,), generator=gen).tolist()
        self.sequences = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict:
        ids = self.sequences[i]
        return {"input_ids": ids, "labels": torch.tensor(int((ids == 7).any()))}


def pad(items: list[dict]) -> dict:
    """The batch as a tokenizer's padding would make it: input_ids, attention_mask, labels."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": torch.stack([item["labels"] for item in items])}


def build(layers: int = 2, hidden: int = 64) -> Task:
    config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=LONGEST, num_labels=CLASSES)
    return Task(model=BertForSequenceClassification(config), dataset=SyntheticReviews(), collate_fn=pad)
