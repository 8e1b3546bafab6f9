"""Tasks shaped as users write them, loaded through `--task path/to/user_tasks.py:factory`: Hugging Face
models with dict batches and their own loss, padding collate functions, iterable datasets (sharded or not,
stateful or not), a branch used every other step, frozen layers, factory arguments.

Iterable tasks record every sample they train on in DDP_AMP_TEST_INDEX_LOG/<pid>.txt, one index a line."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ddp_amp.files import atomic_write  # a reader never sees the pid file empty
from ddp_amp.tasks import Task

VOCAB, SEQ, CLASSES = 64, 12, 3
BERT_ITEMS = 48


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


class _Tokens(Dataset):
    """Synthetic token sequences with padding at the end and a label each, as a tokenizer would give them."""

    def __init__(self, pairs: bool) -> None:
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (BERT_ITEMS, SEQ), generator=gen)
        lengths = torch.randint(4, SEQ + 1, (BERT_ITEMS,), generator=gen)
        self.mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        self.ids = self.ids * self.mask
        self.labels = torch.randint(0, CLASSES, (BERT_ITEMS,), generator=gen)
        self.pairs = pairs

    def __len__(self) -> int:
        return BERT_ITEMS

    def __getitem__(self, i):
        item = {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}
        return (item, self.labels[i]) if self.pairs else item


def bert_dict_items() -> Task:
    """A Hugging Face model as it is: dict items, the model's own loss, no loss_fn."""
    return Task(model=_tiny_bert(), dataset=_Tokens(pairs=False))


class _WithText(_Tokens):
    def __getitem__(self, i):
        return {**super().__getitem__(i), "text": f"sentence {i}"}  # a column the tokenizer left behind


def bert_with_a_text_column() -> Task:
    """A Hugging Face model whose items keep their raw `text`: its forward's **kwargs would swallow it."""
    return Task(model=_tiny_bert(), dataset=_WithText(pairs=False))


class _UnevenLabels(Dataset):
    """32 token sequences whose labels end (-100 after) at very different lengths, 2 to SEQ: pieces, accumulated
    batches and ranks hold very different numbers of label tokens."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(9)
        self.ids = torch.randint(1, VOCAB, (32, SEQ), generator=gen)
        lengths = [2 + (i * 7) % (SEQ - 1) for i in range(32)]
        self.labels = self.ids.clone()
        for i, length in enumerate(lengths):
            self.labels[i, length:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def tiny_llama_uneven_labels() -> Task:
    """A causal LM's own loss, the mean over its label tokens, on sequences of uneven label counts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return Task(model=LlamaForCausalLM(config), dataset=_UnevenLabels())


def tiny_t5_uneven_labels() -> Task:
    """A seq2seq model's own loss, the mean over its label tokens, on targets of uneven lengths (no dropout)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    return Task(model=T5ForConditionalGeneration(config), dataset=_UnevenLabels())


class PlainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x):
        return self.linear(x)


class _WeightedItems(Dataset):
    def __init__(self, weight: float) -> None:
        gen = torch.Generator().manual_seed(5)
        self.x, self.weight = torch.randn(64, 8, generator=gen), weight

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.x[i].sum(0, keepdim=True), "weight": torch.tensor(self.weight)}


def weighted_items(weight: float = 1.0, every_field: bool = False) -> Task:
    """Dict items with a field only the loss needs (a per-sample weight) and a plain `forward(self, x)`."""

    def loss_fn(output, batch):
        return (batch["weight"][:, None] * (output - batch["y"]) ** 2).mean()

    return Task(model=PlainNet(), dataset=_WeightedItems(weight), loss_fn=loss_fn, pass_every_field=every_field)


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hf = _tiny_bert()

    def forward(self, batch):
        return self.hf(**batch)


def bert_wrapped_pairs() -> Task:
    """The glue the dict form replaces: a wrapper calling hf(**batch), (dict, label) pairs, a loss_fn."""
    return Task(model=_Wrapper(), dataset=_Tokens(pairs=True), loss_fn=lambda output, _: output.loss)


class _NoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x, y):
        return self.linear(x)


class _XY(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"x": torch.full((8,), float(i)), "y": torch.zeros(1)}


def output_without_loss() -> Task:
    """Dict items, no loss_fn, and a model whose output is a bare tensor: nothing to train on."""
    return Task(model=_NoLoss(), dataset=_XY())


class _VariableLength(Dataset):
    """Sequences of 2 to 9 tokens: default collation cannot stack them."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(5)
        self.lengths = torch.randint(2, 10, (32,), generator=gen).tolist()
        self.tokens = [torch.randint(1, VOCAB, (n,), generator=gen) for n in self.lengths]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "target": torch.tensor([float(self.lengths[i])])}


def pad(items):
    longest = max(len(item["tokens"]) for item in items)
    tokens = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        tokens[row, :len(item["tokens"])] = item["tokens"]
    return {"tokens": tokens, "mask": (tokens != 0).float(), "target": torch.stack([i["target"] for i in items])}


class _Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, tokens, mask, target):
        pooled = (self.embed(tokens) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.out(pooled)


def padded_sequences() -> Task:
    """Variable-length dict items batched by the task's own padding collate_fn; loss_fn(output, batch)."""
    return Task(model=_Pooled(), dataset=_VariableLength(), collate_fn=pad,
                loss_fn=lambda output, batch: nn.functional.mse_loss(output, batch["target"]))


# Iterable datasets ----------------------------------------------------------------------------------------

STREAM_ITEMS = int(os.environ.get("DDP_AMP_TEST_STREAM_ITEMS", "33"))


def _features(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(8, generator=gen)
    return x, x.sum(0, keepdim=True)


class _Recording(nn.Module):
    """Logs the index of every sample of every forward, as helper_tasks' _RecordingRegression does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.log = os.path.join(os.environ["DDP_AMP_TEST_INDEX_LOG"], f"{os.getpid()}.txt")
        self.pause = float(os.environ.get("DDP_AMP_TEST_STEP_SLEEP", "0"))

    def forward(self, inputs):
        features, index = inputs
        with open(self.log, "a") as f:
            f.write("".join(f"{i}\n" for i in index.tolist()))
        if self.pause:
            time.sleep(self.pause)
        return self.linear(features)


class Stream(IterableDataset):
    """STREAM_ITEMS items ((features, index), target), read in order, unsharded (every rank sees all)."""

    def __iter__(self):
        for index in range(STREAM_ITEMS):
            x, y = _features(index)
            yield (x, index), y


class StatefulStream(Stream):
    """The same stream, resumable where it stood (torchdata's Stateful protocol)."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self):
        while self.position < STREAM_ITEMS:
            index = self.position
            self.position += 1
            x, y = _features(index)
            yield (x, index), y

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def _stop_at_env(loss):
    """DDP_AMP_TEST_STOP_AT=N: rank 0 sends SIGTERM to its process group at its N-th loss."""
    _stop_at_env.calls = getattr(_stop_at_env, "calls", 0) + 1
    if _stop_at_env.calls == int(os.environ.get("DDP_AMP_TEST_STOP_AT", "0")) and os.environ.get("RANK") == "0":
        os.killpg(os.getpgrp(), signal.SIGTERM)
    return loss


def _mse(output, target):
    return _stop_at_env(nn.functional.mse_loss(output, target))


def stream() -> Task:
    return Task(model=_Recording(), dataset=Stream(), loss_fn=_mse)


def stateful_stream() -> Task:
    return Task(model=_Recording(), dataset=StatefulStream(), loss_fn=_mse)


def hf_stream_split_by_node() -> Task:
    """A Hugging Face IterableDataset already split per rank with split_dataset_by_node: not sharded again."""
    from datasets import IterableDataset as HFIterable
    from datasets.distributed import split_dataset_by_node

    def rows():
        for index in range(STREAM_ITEMS):
            x, y = _features(index)
            yield {"x": x.tolist(), "index": index, "y": y.tolist()}

    stream = HFIterable.from_generator(rows).with_format("torch")
    stream = split_dataset_by_node(stream, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))

    def collate(rows):
        return ((torch.stack([r["x"] for r in rows]), torch.tensor([int(r["index"]) for r in rows])),
                torch.stack([r["y"] for r in rows]))

    return Task(model=_Recording(), dataset=stream, loss_fn=_mse, collate_fn=collate)


# DDP's switches, frozen parameters, arguments --------------------------------------------------------------


class _Branchy(nn.Module):
    """A second head used on every other forward only: its parameters get no gradient on the others. `frozen`
    puts a frozen layer first, so that DDP's numbering of the parameters that require gradients differs from
    the numbering of all parameters."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False) if frozen else nn.Identity()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.sometimes = nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        hidden = torch.relu(self.trunk(self.frozen(x)))
        out = self.head(hidden)
        return out + self.sometimes(hidden) if self.calls % 2 else out


class _Regression(Dataset):
    def __init__(self, size: int = 64) -> None:
        gen = torch.Generator().manual_seed(9)
        self.x = torch.randn(size, 8, generator=gen)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def branch_every_other_step(frozen: bool = False) -> Task:
    return Task(model=_Branchy(frozen), dataset=_Regression(), loss_fn=nn.functional.mse_loss)


def frozen_trunk() -> Task:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return Task(model=model, dataset=_Regression(), loss_fn=nn.functional.mse_loss)


class _Scaled(nn.Module):
    """A fixed scale: a buffer, no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8, 1))

    def forward(self, x):
        return x @ self.scale


def nothing_to_train(buffers_only: bool = False) -> Task:
    """A model with nothing to train: every parameter frozen, or (buffers_only) a buffer and no parameter."""
    model = _Scaled() if buffers_only else nn.Linear(8, 1).requires_grad_(False)
    return Task(model=model, dataset=_Regression(), loss_fn=nn.functional.mse_loss)


def sized(width: int, scale: float = 1.0, bias: bool = True, note: str = "", out: Path | None = None) -> Task:
    """A factory with arguments (--task-arg width=16 ...): the model's shape shows what it received."""
    if out is not None:
        Path(out).write_text(repr({"width": width, "scale": scale, "bias": bias, "note": note}))
    model = nn.Sequential(nn.Linear(8, width, bias=bias), nn.ReLU(), nn.Linear(width, 1))
    return Task(model=model, dataset=_Regression(), loss_fn=lambda o, t: nn.functional.mse_loss(o * scale, t))


def optional_width(record: Path, width: int | None = 16, depth: "int | None" = 1) -> Task:
    """Arguments that take None (--task-arg width=none), one annotation evaluated and one written as a string:
    what the factory received is written to `record`."""
    Path(record).write_text(repr({"width": width, "depth": depth}))
    return sized(width or 16)


def unannotated(record, width=16, scale=1.0):
    """Arguments without annotations: each converted by its default's type (a str where the default is None)."""
    Path(record).write_text(repr({"width": width, "scale": scale}))
    return sized(width)


class _IntLabels(Dataset):
    def __init__(self) -> None:
        self.x, self.y = torch.randn(64, 8), torch.randint(0, 2, (64,))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])  # .item() on a meta tensor raises: the launcher cannot look


def int_labels() -> Task:
    """A data set whose items read a number from a tensor: built on the meta device, it cannot give an item."""
    return Task(model=nn.Linear(8, 2), dataset=_IntLabels(), loss_fn=nn.functional.cross_entropy)


class _ReadsKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x, **extra):
        return self.linear(x) * extra["scale"]


def reads_kwargs() -> Task:
    """A forward that names x and reads a field from its **kwargs: it must be given every field."""
    return Task(model=_ReadsKwargs(), dataset=_WeightedItems(1.0), loss_fn=lambda o, b: ((o - b["y"]) ** 2).mean())


def few_samples(count: int) -> Task:
    """A regression on `count` samples (--task-arg count=6): a data set smaller than a batch, or empty."""
    inputs = torch.arange(count * 8, dtype=torch.float32).reshape(count, 8)
    return Task(model=nn.Linear(8, 1), dataset=TensorDataset(inputs, inputs.sum(1, keepdim=True)),
                loss_fn=nn.functional.mse_loss)


class _BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.norm(self.linear(x)))


def batch_norm() -> Task:
    return Task(model=_BatchNormed(), dataset=_Regression(), loss_fn=nn.functional.mse_loss)


def _drop_connections() -> None:
    """Shut down every connection of this process (its listening sockets stay), as a failing link would."""
    import socket

    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # connections, not listeners
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays open (its owner closes it); only the connection is gone


def real_failure_after_peer_sees_it_die() -> Task:
    """Rank 1's connections drop first, so rank 0 fails at once with "Connection closed by peer" (its error is
    the older one), and rank 1 raises the real cause two seconds later."""
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        if calls == 3 and os.environ.get("RANK") == "1":
            _drop_connections()
            time.sleep(2)
            raise ValueError("the real cause, on rank 1")
        return nn.functional.mse_loss(output, target)

    return Task(model=nn.Linear(8, 1), dataset=_Regression(), loss_fn=loss_fn)


# Validation, the best step, fine-tuning -----------------------------------------------------------------------

VAL_SAMPLES = 37  # odd: 2 ranks cannot share it evenly, so padding (a duplicate) would show in the mean


class _Line(Dataset):
    def __init__(self, size: int, slope: float, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 1, generator=gen)
        self.y = slope * self.x + 0.05 * torch.randn(size, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _abs_error(output, target):
    return {"abs_error": (output - target).abs().mean()}


def with_validation() -> Task:
    """A regression with an odd-sized validation set and a metric beside the loss."""
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    return Task(model=model, dataset=_Line(64, 2.0, 1), loss_fn=nn.functional.mse_loss,
                val_dataset=_Line(VAL_SAMPLES, 2.0, 2), val_metrics=_abs_error)


def _seven_on_some_batches(output, target):
    """A metric a batch may not report (here: those whose first target is negative), 7 wherever it is."""
    return {"abs_error": (output - target).abs().mean(), **({"seven": torch.tensor(7.0)} if target[0] > 0 else {})}


def _batch_samples(output, target):
    """Each validation batch's own sample count: its sample-weighted mean is sum(n^2) / sum(n)."""
    return {"batch_samples": torch.tensor(float(target.shape[0]))}


def reports_validation_batches() -> Task:
    """with_validation, its one metric the size of the batch it was computed on."""
    task = with_validation()
    task.val_metrics = _batch_samples
    return task


def metric_on_some_batches() -> Task:
    """with_validation, its val_metrics reporting `seven` on some batches only: its mean is 7."""
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    return Task(model=model, dataset=_Line(64, 2.0, 1), loss_fn=nn.functional.mse_loss,
                val_dataset=_Line(VAL_SAMPLES, 2.0, 2), val_metrics=_seven_on_some_batches)


def val_passes_optimum() -> Task:
    """Training pulls the weight from 0 to 2; the validation set's best is 1, passed on the way: its loss falls,
    then rises, so the best step is in the middle of the run."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    pause = float(os.environ.get("DDP_AMP_TEST_STEP_SLEEP", "0"))

    def loss_fn(output, target):
        if pause:
            time.sleep(pause)
        return _stop_at_env(nn.functional.mse_loss(output, target))

    return Task(model=model, dataset=_Line(64, 2.0, 3), loss_fn=loss_fn, val_dataset=_Line(VAL_SAMPLES, 1.0, 4),
                val_metrics=_abs_error)


def stops_in_evaluation() -> Task:
    """Rank 0 sends SIGTERM to its process group from inside its first evaluation's first batch (a slow
    evaluation: 0.1 s a batch, 25 batches a rank); every metric call is counted in DDP_AMP_TEST_INDEX_LOG."""
    log = Path(os.environ["DDP_AMP_TEST_INDEX_LOG"]) / f"metric-calls-{os.getpid()}.txt"
    calls = 0

    def metrics(output, target):
        nonlocal calls
        calls += 1
        with open(log, "a") as f:
            f.write("call\n")
        if calls == 1 and os.environ.get("RANK") == "0":
            os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(0.1)
        return _abs_error(output, target)

    task = with_validation()
    task.val_dataset, task.val_metrics = _Line(200, 2.0, 2), metrics
    return task


class _ReportsStart(nn.Module):
    """Writes, at its first forward, the exact bytes of its weights to DDP_AMP_TEST_INDEX_LOG/start-<rank>.pt."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))
        self.reported = False

    def forward(self, x):
        if not self.reported:
            self.reported = True
            torch.save(self.net.state_dict(), Path(os.environ["DDP_AMP_TEST_INDEX_LOG"]) /
                       f"start-{os.environ['RANK']}.pt")
        return self.net(x)


def reports_start(width: int = 5) -> Task:
    return Task(model=_ReportsStart(width), dataset=_Regression(), loss_fn=nn.functional.mse_loss)


def validation_loss_only() -> Task:
    """A validation set without val_metrics: the evaluation logs val_loss alone."""
    task = with_validation()
    task.val_metrics = None
    return task


class _SavesPretrained(nn.Module):
    """A model of the user's own with a save_pretrained (its state_dict in pytorch_model.bin), as export --hf
    writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x):
        return self.linear(x)

    def save_pretrained(self, directory) -> None:
        if why := os.environ.get("DDP_AMP_TEST_SAVE_PRETRAINED_RAISES"):
            (Path(directory) / "partial.bin").write_bytes(b"half")
            if why == "exit":
                sys.exit(3)
            raise OSError(why)
        torch.save(self.state_dict(), Path(directory) / "pytorch_model.bin")


def saves_pretrained() -> Task:
    """Records the pid that built it in DDP_AMP_TEST_FACTORY_PID's file; raises DDP_AMP_TEST_FACTORY_RAISES."""
    if record := os.environ.get("DDP_AMP_TEST_FACTORY_PID"):
        atomic_write(Path(record), str(os.getpid()).encode())
    if why := os.environ.get("DDP_AMP_TEST_FACTORY_RAISES"):
        raise ValueError(why)
    return Task(model=_SavesPretrained(), dataset=_Regression(), loss_fn=nn.functional.mse_loss)
