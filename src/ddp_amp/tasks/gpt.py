"""A GPT-2-style decoder in the sizes a user trains on an accelerator: `--task gpt --task-arg size=124m`.

Sizes (`SIZES`): `tiny`, the default, trains in seconds on a CPU; `124m` and `350m` are GPT-2 small and medium
(nanoGPT's configuration: vocabulary padded to 50304, 1024 tokens of context, biases, GELU, pre-norm blocks,
causal `scaled_dot_product_attention`, the output layer tied to the token embedding). Nothing is downloaded:
the tokens are a generated walk with structure to learn, each token followed by one of a few fixed offsets of
itself, at fixed probabilities, so the loss can fall to the offsets' entropy (`entropy_floor`, nats per token).

Its FLOPs per token are nanoGPT's (and PaLM's) count, 6 N + 12 L d T (N the parameters without the position
embedding; attention counted whole, as if not causal), so its MFU reads as nanoGPT's `estimate_mfu` does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    context: int
    vocab: int

    def parameters(self, position_embedding: bool = True) -> int:
        """The parameter count, from the shapes (no model built): the tied output layer counted once."""
        d = self.width
        blocks = self.layers * (12 * d * d + 13 * d)  # qkv, projection and the MLP's two layers; biases, norms
        return self.vocab * d + (self.context * d if position_embedding else 0) + blocks + 2 * d

    def flops_per_token(self) -> float:
        return 6 * self.parameters(position_embedding=False) + 12 * self.layers * self.width * self.context


SIZES = {
    "tiny": GPTConfig(layers=2, width=128, heads=4, context=128, vocab=512),
    "124m": GPTConfig(layers=12, width=768, heads=12, context=1024, vocab=50304),
    "350m": GPTConfig(layers=24, width=1024, heads=16, context=1024, vocab=50304),
}
SEQUENCES = 2048
"""Training sequences (an epoch); a longer run goes round them again, reshuffled."""
VAL_SEQUENCES = 64
OFFSETS = 4
DATA_SEED = 1234


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.width)
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.proj(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.width)
        self.pos = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's
        self.apply(self._init)
        for name, parameter in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def token_walks(config: GPTConfig, *counts: int) -> tuple[list[torch.Tensor], float]:
    """Sequences of context + 1 tokens, `counts` of them per set, and the walk's entropy per token: each token is
    the one before plus one of OFFSETS fixed offsets (mod the vocabulary), drawn at fixed probabilities."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    offsets = torch.randint(1, config.vocab, (OFFSETS,), generator=gen)
    probs = torch.softmax(torch.randn(OFFSETS, generator=gen) * 2, dim=0)
    entropy = -(probs * probs.log()).sum().item()
    sets = []
    for count in counts:
        starts = torch.randint(0, config.vocab, (count, 1), generator=gen)
        steps = offsets[torch.multinomial(probs, count * config.context, replacement=True, generator=gen)]
        walk = torch.cat([starts, steps.view(count, config.context)], dim=1).cumsum(dim=1) % config.vocab
        sets.append(walk)
    return sets, entropy


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build(size: Literal["tiny", "124m", "350m"] = "tiny") -> Task:
    config = SIZES[size]
    (train, val), entropy = token_walks(config, SEQUENCES, VAL_SEQUENCES)
    return Task(
        model=functools.partial(GPT, config),  # built by each rank (on the meta device under --shard full)
        dataset=TensorDataset(train[:, :-1], train[:, 1:]),
        val_dataset=TensorDataset(val[:, :-1], val[:, 1:]),
        loss_fn=cross_entropy,
        evaluate=lambda model: {"entropy_floor": entropy, "uniform_loss": math.log(config.vocab)},
        items_per_sample=config.context,
        item_name="tokens",
        flops_per_item=config.flops_per_token(),
        shard_units=(Block,),
        description=f"GPT-2-style decoder, size {size}: {config.parameters() / 1e6:.1f} M parameters "
                    f"({config.layers} layers, width {config.width}, {config.heads} heads), "
                    f"{config.context} tokens per sequence",
    )
