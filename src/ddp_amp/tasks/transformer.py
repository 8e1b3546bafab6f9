"""A small causal language model on a synthetic token stream with learnable structure.

The stream comes from a fixed random Markov chain in which every token has a few likely successors, so the
model can learn it down to the chain's entropy (reported as `entropy_floor`, in nats per token). A further
stretch of the same walk is its validation set (--eval-every, --keep-best val_loss).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddp_amp.tasks import Task

VOCAB = 64
SEQ_LEN = 64
D_MODEL = 128
HEADS = 4
LAYERS = 2
SEQUENCES = 2048
VAL_SEQUENCES = 256
SUCCESSORS = 4
DATA_SEED = 1234


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, seq_len: int = SEQ_LEN, d_model: int = D_MODEL, heads: int = HEADS,
                 layers: int = LAYERS) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.tok(tokens) + self.pos(positions))))


def _markov_streams(gen: torch.Generator, *lengths: int) -> tuple[list[torch.Tensor], float]:
    """Streams of the given lengths, one walk of one chain cut in pieces, and the chain's entropy."""
    successors = torch.stack([torch.randperm(VOCAB, generator=gen)[:SUCCESSORS] for _ in range(VOCAB)])
    probs = torch.softmax(torch.randn(VOCAB, SUCCESSORS, generator=gen) * 2, dim=1)
    entropy = -(probs * probs.log()).sum(dim=1).mean().item()  # uniform over states: close enough for a floor
    # The walk is sequential; plain Python lists keep it to a fraction of a second.
    next_of = successors.tolist()
    state, streams = 0, []
    for length in lengths:  # one draw per piece, so a piece added at the end leaves the earlier ones as they were
        choices = torch.multinomial(probs, length, replacement=True, generator=gen).tolist()  # (VOCAB, length)
        stream = []
        for i in range(length):
            state = next_of[state][choices[state][i]]
            stream.append(state)
        streams.append(torch.tensor(stream))
    return streams, entropy


def build() -> Task:
    gen = torch.Generator().manual_seed(DATA_SEED)
    (stream, val_stream), entropy = _markov_streams(gen, SEQUENCES * (SEQ_LEN + 1), VAL_SEQUENCES * (SEQ_LEN + 1))
    windows = stream.view(SEQUENCES, SEQ_LEN + 1)
    val_windows = val_stream.view(VAL_SEQUENCES, SEQ_LEN + 1)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    model = TinyLM()
    # nanoGPT's N: the parameters a token's matmuls use. Not the position embedding (nanoGPT leaves it out), nor the
    # token embedding: a lookup here, the output layer `head` being a layer of its own (GPT-2's is the embedding).
    parameters = sum(p.numel() for p in model.parameters()) - model.tok.weight.numel() - model.pos.weight.numel()
    # 6 FLOPs per parameter per token (forward + backward), plus attention scores and values.
    flops_per_token = 6 * parameters + 12 * LAYERS * D_MODEL * SEQ_LEN
    return Task(
        model=model,
        dataset=TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous()),
        val_dataset=TensorDataset(val_windows[:, :-1].contiguous(), val_windows[:, 1:].contiguous()),
        loss_fn=loss_fn,
        evaluate=lambda model: {"entropy_floor": entropy, "uniform_loss": math.log(VOCAB)},
        items_per_sample=SEQ_LEN,
        item_name="tokens",
        flops_per_item=flops_per_token,
    )
