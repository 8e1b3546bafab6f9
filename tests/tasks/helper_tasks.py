"""Tasks used by the tests, loaded through `--task path/to/helper_tasks.py:factory` like a user's own.

Each is a small regression whose loss function does something on a chosen call (1-based micro-step).
"""

import os
import signal
import time
from collections import namedtuple
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ddp_amp.files import atomic_write  # a reader never sees the pid file empty
from ddp_amp.tasks import Task

INF_AT_CALL = 3  # the loss of this micro-step is multiplied by inf
SLOW_STEPS = 3  # the first micro-steps of slow_start sleep, as a cold start would


def _regression_with(on_call) -> Task:
    """A linear regression whose loss goes through `on_call(call, loss) -> loss` on every call."""
    gen = torch.Generator().manual_seed(7)
    # Small values: fp16 gradients at GradScaler's initial scale (65536) stay finite unless we make them inf.
    x = 0.1 * torch.randn(512, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        return on_call(calls, nn.functional.mse_loss(output, target))

    return Task(model=nn.Linear(8, 1), dataset=TensorDataset(x, y), loss_fn=loss_fn)


def inf_at_third_step() -> Task:
    """The third loss is inf: its gradients overflow, GradScaler must skip that step."""
    return _regression_with(lambda call, loss: loss * float("inf") if call == INF_AT_CALL else loss)


def fail_on_rank1() -> Task:
    """Rank 1 raises at its fifth step; rank 0 trains on and would wait for it forever if nobody stopped it."""

    def on_call(call, loss):
        if call == 5 and os.environ.get("RANK") == "1":
            raise ValueError("injected failure at step 5")
        return loss

    return _regression_with(on_call)


def fail_on_rank1_at_first_step() -> Task:
    """Rank 1 raises in its first step: the run fails before it trained (nothing logged, nothing kept)."""

    def on_call(call, loss):
        if os.environ.get("RANK") == "1":
            raise ValueError("injected failure at step 1")
        return loss

    return _regression_with(on_call)


SPARED_VAR = "DDP_AMP_TEST_SPARED"


def killed_once() -> Task:
    """Rank 1 is SIGKILLed at its third step of the first attempt; a torchrun restart then runs clean, and so
    does a launch with $DDP_AMP_TEST_SPARED set."""

    def on_call(call, loss):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if call == 3 and first_attempt and os.environ.get("RANK") == "1" and not os.environ.get(SPARED_VAR):
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    return _regression_with(on_call)


def slow_start() -> Task:
    """The first SLOW_STEPS steps each sleep 0.5 s: a timing that counted warm-up would show it."""

    def on_call(call, loss):
        if call <= SLOW_STEPS:
            time.sleep(0.5)
        return loss

    return _regression_with(on_call)


def slow_disk_after_step_4() -> Task:
    """The linear regression, whose checkpoints after step 4 take 60 s to write (a slow disk), before their first
    byte: a stop's checkpoint outlasts any short --stop-timeout."""
    from ddp_amp.checkpoint import storage

    write = storage.atomic_write

    def slow(path, *args, **options):
        if path.suffix == ".pt" and path.stem.startswith("step-") and int(path.stem.split("-")[1]) > 4:
            time.sleep(60)
        return write(path, *args, **options)

    storage.atomic_write = slow
    return _regression_with(lambda call, loss: loss)


def not_a_task():
    return "a string, not a Task"


def eval_fails() -> Task:
    """Trains normally; its evaluation raises."""
    task = _regression_with(lambda call, loss: loss)

    def evaluate(model, device):
        raise RuntimeError("evaluation exploded")

    task.evaluate = evaluate
    return task


def eval_reports_device() -> Task:
    """Its evaluation reports whether it was handed the device the model is on, and the model's mode."""
    task = _regression_with(lambda call, loss: loss)

    def evaluate(model, device):
        on_device = next(model.parameters()).device == torch.device(device)
        return {"on_model_device": float(on_device), "training_mode": float(model.training)}

    task.evaluate = evaluate
    return task


Target = namedtuple("Target", ["value", "weight"])


class _StructuredData(Dataset):
    """Items are ({"x": features}, Target(value, weight)): a dict for inputs, a namedtuple for targets."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(64, 4, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index]}, Target(self.y[index], torch.ones(1))


class _DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, inputs):
        return self.linear(inputs["x"])


def structured_batches() -> Task:
    def loss_fn(output, target):
        return ((output - target.value) ** 2 * target.weight).mean()

    return Task(model=_DictModel(), dataset=_StructuredData(), loss_fn=loss_fn)


DRAWS_DIR_VAR = "DDP_AMP_TEST_DRAWS_DIR"
RECORDED_DRAWS = 3


class _DrawsInForward(nn.Module):
    """Draws a random number in every forward pass (as dropout does) and records the first few per rank."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.draws = []

    def forward(self, x):
        noise = torch.rand(())
        self.draws.append(noise.item())
        if len(self.draws) == RECORDED_DRAWS:
            path = os.path.join(os.environ[DRAWS_DIR_VAR], f"rank{os.environ['RANK']}.txt")
            with open(path, "w") as f:
                f.write(" ".join(repr(d) for d in self.draws))
        return self.linear(x) + 0 * noise


def draws_in_forward() -> Task:
    task = _regression_with(lambda call, loss: loss)
    task.model = _DrawsInForward()
    return task


NAN_FROM_CALL = 4


def nan_on_rank1() -> Task:
    """From its fourth step on, rank 1's loss is NaN (and so, through the all-reduce, every rank's weights)."""
    return _regression_with(
        lambda call, loss: loss * float("nan") if call >= NAN_FROM_CALL and os.environ.get("RANK") == "1" else loss
    )


def always_inf() -> Task:
    """Every loss is inf: under fp16 GradScaler skips every step and its scale collapses."""
    return _regression_with(lambda call, loss: loss * float("inf"))


def hang_on_rank1() -> Task:
    """Rank 1 hangs in its fifth step's loss (as a stuck data read or a deadlock would); rank 0 waits for it."""

    def on_call(call, loss):
        if call == 5 and os.environ.get("RANK") == "1":
            time.sleep(3600)
        return loss

    return _regression_with(on_call)


class _TripleItems(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.zeros(8), torch.zeros(1), index


def triple_items() -> Task:
    """Breaks the contract: each item is a triple, neither an (inputs, target) pair nor a mapping."""
    return Task(model=nn.Linear(8, 1), dataset=_TripleItems(), loss_fn=nn.functional.mse_loss)


class _NoisyRegression(nn.Module):
    """Dropout in the forward pass: bit-identical resumes need every rank's RNG state restored."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.hidden(x))))


def resumable() -> Task:
    """A regression with dropout, steered by environment variables for fault tests:
    DDP_AMP_TEST_STEP_SLEEP seconds per step; DDP_AMP_TEST_KILL_AT: rank 1 SIGKILLs itself at that step of the
    first attempt; DDP_AMP_TEST_DAMAGE=KIND:PATH: before that, it damages the sharded checkpoint PATH (once its
    write is done) in one of the ways of DAMAGES; DDP_AMP_TEST_BIG_SAMPLE: one sample 10^4 times larger, whose
    fp16 gradients overflow whenever it is in a batch (a GradScaler skip that depends on the data, so it recurs
    identically on resume)."""
    pause = float(os.environ.get("DDP_AMP_TEST_STEP_SLEEP", "0"))
    kill_at = int(os.environ.get("DDP_AMP_TEST_KILL_AT", "0"))
    damage = os.environ.get("DDP_AMP_TEST_DAMAGE")

    def on_call(call, loss):
        if pause:
            time.sleep(pause)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if call == kill_at and first_attempt and os.environ.get("RANK") == "1":
            if damage:
                kind, path = damage.split(":", 1)
                damage_when_written(kind, Path(path))
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    task = _regression_with(on_call)
    task.model = _NoisyRegression()
    if os.environ.get("DDP_AMP_TEST_BIG_SAMPLE"):
        x, y = task.dataset.tensors
        x, y = x.clone(), y.clone()
        x[0] *= 1e4
        y[0] *= 1e4
        task.dataset = TensorDataset(x, y)
    return task


def _lose_metadata(step: Path) -> None:
    (step / ".metadata").unlink()


def _truncate_metadata(step: Path) -> None:
    data = (step / ".metadata").read_bytes()
    (step / ".metadata").write_bytes(data[: len(data) // 2])


def _lose_a_part(step: Path) -> None:
    (step / "__1_0.distcp").unlink()


def _truncate_a_part(step: Path) -> None:
    part = step / "__0_0.distcp"
    part.write_bytes(part.read_bytes()[:100])


def flip_byte(path: Path, offset: int) -> None:
    """One byte of the file inverted in place: its size unchanged, as a failing disk or bit rot leaves it."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _flip_in_tensor(checkpoint: Path, pick) -> None:
    """A byte flipped in the middle of the storage of the tensor `pick(state)` of a single-file checkpoint, found
    by its bytes in the file: the file still unpickles, and holds other numbers there."""
    tensor = pick(torch.load(checkpoint, map_location="cpu", weights_only=True)["trainer"])
    data, wanted = checkpoint.read_bytes(), tensor.contiguous().view(torch.uint8).numpy().tobytes()
    offset = data.find(wanted)
    assert offset >= 0 and data.find(wanted, offset + 1) < 0, "the tensor's bytes are not found once in the file"
    flip_byte(checkpoint, offset + len(wanted) // 2)


def _flip_in_model(checkpoint: Path) -> None:
    _flip_in_tensor(checkpoint, lambda trainer: next(iter(trainer["model"].values())))


def _flip_in_optimizer(checkpoint: Path) -> None:
    _flip_in_tensor(checkpoint, lambda trainer: trainer["optimizer"]["state"][0]["exp_avg"])


def _flip_in_a_part(step: Path) -> None:
    part = step / "__1_0.distcp"
    flip_byte(part, part.stat().st_size // 2)


def _flip_in_metadata(step: Path) -> None:
    flip_byte(step / ".metadata", (step / ".metadata").stat().st_size // 2)


# The ways a copy or a kill leaves a 2-rank sharded checkpoint directory damaged, or a byte flipped in place in
# it (a failing disk, a copy from object storage gone wrong, bit rot); and a byte flipped in a single file.
SHARDED_DAMAGES = {"metadata-missing": _lose_metadata, "metadata-truncated": _truncate_metadata,
                   "part-missing": _lose_a_part, "part-truncated": _truncate_a_part, "flip-part": _flip_in_a_part,
                   "flip-metadata": _flip_in_metadata}
SINGLE_FILE_DAMAGES = {"flip-model": _flip_in_model, "flip-optimizer": _flip_in_optimizer}
DAMAGES = {**SHARDED_DAMAGES, **SINGLE_FILE_DAMAGES}


def damage_when_written(kind: str, step: Path, timeout_s: float = 60) -> None:
    """Damages the checkpoint `step` (step-N/ or step-N.pt) in the way DAMAGES names `kind`, once its sidecar says
    the background write is done."""
    deadline = time.monotonic() + timeout_s
    while not step.with_name(step.name.removesuffix(".pt") + ".json").exists():
        assert time.monotonic() < deadline, f"{step} was never written"
        time.sleep(0.05)
    DAMAGES[kind](step)


class Planted:
    """Not data: unpickling it runs code (it creates the file named in its argument)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


HOLD_AT_CALL = 12  # waits_for_a_third_node holds here while the world has fewer than three ranks


def _hold_while_world_below(wanted: int) -> None:
    """Waits while the world has fewer than `wanted` ranks, until this rank is asked to stop: the SIGTERM of
    its agent at the membership change, which the rank then takes as a stop at one step, as it does in training."""
    from ddp_amp.rank.signals import STOP_REQUEST

    while int(os.environ["WORLD_SIZE"]) < wanted and STOP_REQUEST.signum is None:
        time.sleep(0.1)


def waits_for_a_third_node() -> Task:
    """Trains to HOLD_AT_CALL, then, while the world has fewer than 3 ranks, waits there (every rank alike, so no
    collective times out): only an elastic restart with a third node lets the job go on."""

    def on_call(call, loss):
        if call == HOLD_AT_CALL:
            _hold_while_world_below(3)
        return loss

    return _regression_with(on_call)


def group_stop_in_evaluate() -> Task:
    """Its evaluation sends SIGTERM to the whole process group (as `kill -TERM -PGID` or a scheduler would) while
    it runs, after model.pt is written: the stop comes too late to stop anything. Launch it in a session of
    its own."""
    task = _regression_with(lambda call, loss: loss)

    def evaluate(model):
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(1.0)  # the launcher passes the signal on while this evaluation still runs
        return {"evaluated": True}

    task.evaluate = evaluate
    return task


def holds_until_stopped() -> Task:
    """With DDP_AMP_TEST_HOLD_AT=N, on the first attempt of a Slurm job (SLURM_RESTART_COUNT unset or 0): each rank
    holds in its N-th micro-step until it has received a stop signal, after touching held-rank<R> in
    DDP_AMP_TEST_HOLD_DIR. However late the scheduler's signal comes, it lands at step N; a requeued attempt,
    and a job without the variable, train straight through."""
    from ddp_amp.rank.signals import STOP_REQUEST

    hold_at = int(os.environ.get("DDP_AMP_TEST_HOLD_AT", "0"))
    first_attempt = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"

    def on_call(call, loss):
        if call == hold_at and first_attempt:
            held = os.path.join(os.environ["DDP_AMP_TEST_HOLD_DIR"], f"held-rank{os.environ['RANK']}")
            open(held, "w").close()
            while STOP_REQUEST.signum is None:
                time.sleep(0.05)
        return loss

    return _regression_with(on_call)


class _IndexedDataset(Dataset):
    """Items ((features, index), target): the model sees which samples it trains on."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(11)
        self.x = torch.randn(size, 8, generator=gen)
        self.y = self.x @ torch.randn(8, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        return (self.x[index], index), self.y[index]


class _RecordingRegression(nn.Module):
    """Appends the index of every sample of every forward to DDP_AMP_TEST_INDEX_LOG/<pid>.txt, one a line."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.log = os.path.join(os.environ["DDP_AMP_TEST_INDEX_LOG"], f"{os.getpid()}.txt")

    def forward(self, inputs):
        features, index = inputs
        with open(self.log, "a") as f:
            f.write("".join(f"{i}\n" for i in index.tolist()))
        return self.linear(features)


INDEXED_SAMPLES = 96  # divisible by 8 samples x 1, 2 or 3 ranks: no padding, every epoch exactly the data set


def records_indices() -> Task:
    """Records every sample index it trains on (see _RecordingRegression). DDP_AMP_TEST_STEP_SLEEP seconds per
    step; with DDP_AMP_TEST_STOP_AT=N, rank 0 sends SIGTERM to its process group in its N-th step, as `kill
    -TERM -PGID` would (launch it in a session of its own)."""
    pause = float(os.environ.get("DDP_AMP_TEST_STEP_SLEEP", "0"))
    stop_at = int(os.environ.get("DDP_AMP_TEST_STOP_AT", "0"))
    calls = 0

    def loss_fn(output, target):
        nonlocal calls
        calls += 1
        if pause:
            time.sleep(pause)
        if calls == stop_at and os.environ.get("RANK") == "0":
            os.killpg(os.getpgrp(), signal.SIGTERM)
        return nn.functional.mse_loss(output, target)

    return Task(model=_RecordingRegression(), dataset=_IndexedDataset(INDEXED_SAMPLES), loss_fn=loss_fn)


def nan_from_step_12() -> Task:
    """The loss is NaN on every rank from the 12th step on: the weights turn NaN at that step's update."""
    return _regression_with(lambda call, loss: loss * float("nan") if call >= 12 else loss)


def waits_for_world() -> Task:
    """With DDP_AMP_TEST_WORLD=N: trains to HOLD_AT_CALL, then waits there (every rank alike) while the world has
    fewer than N ranks; only an elastic restart with more nodes lets the job go on. Without it, plain training."""
    wanted = int(os.environ.get("DDP_AMP_TEST_WORLD", "0"))

    def on_call(call, loss):
        if call == HOLD_AT_CALL:
            _hold_while_world_below(wanted)
        return loss

    return _regression_with(on_call)


SLOW_STEP_S = 0.05


def slow_until_world() -> Task:
    """With DDP_AMP_TEST_WORLD=N: every rank sleeps SLOW_STEP_S in each loss while the world has fewer than N
    ranks, so a job goes on training (no hold: the ranks reach a step boundary, as real training does) until
    an elastic restart with more nodes makes it fast."""
    wanted = int(os.environ.get("DDP_AMP_TEST_WORLD", "0"))

    def on_call(call, loss):
        if int(os.environ["WORLD_SIZE"]) < wanted:
            time.sleep(SLOW_STEP_S)
        return loss

    return _regression_with(on_call)


def inf_every_other_call() -> Task:
    """Every second loss is inf: under fp16 every second step is skipped, never two in a row."""
    return _regression_with(lambda call, loss: loss * float("inf") if call % 2 == 0 else loss)


def loss_is_the_rank() -> Task:
    """Rank r's loss is r (plus 0 x the real loss, so gradients exist): the logged, global loss of 2 ranks is 0.5."""
    rank = float(os.environ.get("RANK", "0"))
    return _regression_with(lambda call, loss: 0 * loss + rank)


EVALUATION_BYTES = 2 * 2**30


def memory_hungry_evaluation() -> Task:
    """Training is small; the evaluation touches 2 GiB: the run's peak memory is that of the training."""
    task = _regression_with(lambda call, loss: loss)

    def evaluate(model, device):
        block = torch.ones(EVALUATION_BYTES // 4, device=device)  # written, so resident
        return {"block_sum": float(block[::4096].sum())}

    task.evaluate = evaluate
    return task


def subnormal_activations() -> Task:
    """Inputs and frozen weights of ~1e-20: every product, so every activation, is ~1e-40, below fp32's
    smallest normal (1.2e-38), unless the rank flushes subnormals to zero. The trained layer after it sees
    those activations too."""
    gen = torch.Generator().manual_seed(7)
    x = 1e-20 * (1 + torch.rand(256, 64, generator=gen))
    tiny = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        tiny.weight.copy_(1e-20 * (1 + torch.rand(64, 64, generator=gen)))
    tiny.weight.requires_grad_(False)
    model = nn.Sequential(tiny, nn.Linear(64, 64, bias=False))
    return Task(model=model, dataset=TensorDataset(x, torch.zeros(256, 64)), loss_fn=nn.functional.mse_loss)


OOM_ABOVE = 8  # oom_above_8_on_rank1: rank 1 "runs out of memory" on a micro-batch of more samples


def _fails_above(limit: int, error, *, rank: str | None = None) -> Task:
    """A regression whose model raises `error` in forward for any micro-batch above `limit` samples (on `rank`
    alone, if given): the other ranks go on into backward and the agreement, as they would on a GPU."""
    task = _regression_with(lambda call, loss: loss)
    inner = task.model

    class FailsWhenWide(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if (rank is None or os.environ.get("RANK") == rank) and x.shape[0] > limit:
                raise error
            return self.inner(x)

    task.model = FailsWhenWide()
    return task


def oom_above_8_on_rank1() -> Task:
    """torch.OutOfMemoryError on rank 1 alone above OOM_ABOVE samples."""
    return _fails_above(OOM_ABOVE, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"),
                        rank="1")


ONEDNN_FAILURE = "could not create a primitive"


def onednn_failure_above(limit: int) -> Task:
    """oneDNN's allocation failure as an avx512_bf16 CPU reports it under RLIMIT_DATA ("could not create a
    primitive", a RuntimeError the CPU allocator's message does not match), on every rank, above `limit`
    samples (--task-arg limit=N; 0: always)."""
    return _fails_above(limit, RuntimeError(ONEDNN_FAILURE))


ACTIVATION_HEAVY = (64, 16384, 10)


def activation_heavy() -> Task:
    """A 64-16384-10 MLP whose activations dominate its memory: 4096 samples need about 0.5 GiB of them per
    layer, so under --max-memory 1 a batch of 4096 fails in the CPU allocator and 2048 trains."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(8192, ACTIVATION_HEAVY[0], generator=gen)
    y = torch.randint(0, ACTIVATION_HEAVY[2], (8192,), generator=gen)
    model = nn.Sequential(nn.Linear(ACTIVATION_HEAVY[0], ACTIVATION_HEAVY[1]), nn.GELU(),
                          nn.Linear(ACTIVATION_HEAVY[1], ACTIVATION_HEAVY[2]))
    return Task(model=model, dataset=TensorDataset(x, y), loss_fn=nn.functional.cross_entropy)


def slow_to_build(marker: Path, build_s: float = 120.0) -> Task:
    """A factory that takes long (a data set read from a slow disk, say): writes its pid to `marker`, then
    sleeps `build_s` seconds."""
    atomic_write(Path(marker), str(os.getpid()).encode())
    time.sleep(build_s)
    return plain_regression()


def plain_regression() -> Task:
    """The linear regression alone: no dropout, so any split of a batch draws no random numbers."""
    return _regression_with(lambda call, loss: loss)


def oom_on_rank1_at_call_3() -> Task:
    """Rank 1's third forward raises torch.OutOfMemoryError, whatever the batch: under --micro-batch auto the
    size has settled by then (one piece a step), as when the memory a step needs grows later in a run."""
    task = _regression_with(lambda call, loss: loss)
    inner, calls = task.model, [0]

    class FailsOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls[0] += 1
            if os.environ.get("RANK") == "1" and calls[0] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return self.inner(x)

    task.model = FailsOnce()
    return task


def broadcast_instead_on_rank1() -> Task:
    """Rank-dependent control flow, the common bug: at its third loss, rank 1 alone broadcasts 9 numbers while
    rank 0 goes on to DDP's gradient all-reduce of 9 numbers: the same sizes, another collective."""
    import torch.distributed as dist

    def on_call(call, loss):
        if call == 3 and os.environ.get("RANK") == "1":
            dist.broadcast(torch.zeros(9), src=1)
        return loss

    return _regression_with(on_call)


STRAGGLER_SLEEP_S = 0.02


def rank1_sleeps_each_step() -> Task:
    """Rank 1 sleeps STRAGGLER_SLEEP_S in every loss (its forward): the straggler of a 2-rank run."""

    def on_call(call, loss):
        if os.environ.get("RANK") == "1":
            time.sleep(STRAGGLER_SLEEP_S)
        return loss

    return _regression_with(on_call)


def extra_all_reduce_on_rank1() -> Task:
    """Rank-dependent control flow of another size: at its third loss rank 1 alone all-reduces 20 numbers
    while rank 0 goes on to DDP's all-reduce of 9; gloo aborts the rank that receives the wrong size."""
    import torch.distributed as dist

    def on_call(call, loss):
        if call == 3 and os.environ.get("RANK") == "1":
            dist.all_reduce(torch.zeros(20))
        return loss

    return _regression_with(on_call)


def dies_in_evaluation_once() -> Task:
    """Rank 0 SIGKILLs itself in its evaluation after training, in the first attempt of a torchrun job only:
    the other rank has finished by then and waits, in torch's wrapper, for its agent to let it go."""
    task = _regression_with(lambda call, loss: loss)

    def evaluate(model):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return {"evaluated": 1.0}

    task.evaluate = evaluate
    return task


def names_missing_shard_units() -> Task:
    """--shard full's units named by a class the model does not have."""
    task = plain_regression()
    task.shard_units = ["Nowhere"]
    return task


class _ShiftedMLP(nn.Module):
    """Three layers after a shift by a non-persistent buffer: a rank that kept its own copy of the buffer, not
    rank 0's, would train other weights."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.hidden, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 8), persistent=False)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(torch.relu(self.first(x + self.shift)))))


def model_as_function(record: Path | None = None) -> Task:
    """plain_regression's data, and as Task.model the function that builds the model; each call appends
    '<RANK> <the device it built on>' to `record`."""

    def build() -> nn.Module:
        model = _ShiftedMLP()
        if record is not None:
            with open(record, "a") as out:
                out.write(f"{os.environ.get('RANK')} {model.first.weight.device.type}\n")
        return model

    task = plain_regression()
    task.model = build
    return task


def model_on_meta() -> Task:
    """A model given without values: built under torch.device("meta")."""
    task = plain_regression()
    with torch.device("meta"):
        task.model = nn.Linear(8, 1)
    return task


ALL_GATHERS_DIR_VAR = "DDP_AMP_TEST_ALL_GATHERS_DIR"


def counted_all_gathers() -> Task:
    """The mlp task, whose rank writes the bytes of each of FSDP2's all-gathers (its input, this rank's shard) to
    $DDP_AMP_TEST_ALL_GATHERS_DIR/rank<R>.txt, one line each: through FSDP2's own collective class, which every
    all-gather of a fully_shard module goes through."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from ddp_amp.tasks.mlp import build

    path = os.path.join(os.environ[ALL_GATHERS_DIR_VAR], f"rank{os.environ['RANK']}.txt")
    original = DefaultAllGather.__call__

    def counting(self, output_tensor, input_tensor, *args, **kwargs):
        with open(path, "a") as f:
            f.write(f"{input_tensor.numel() * input_tensor.element_size()}\n")
        return original(self, output_tensor, input_tensor, *args, **kwargs)

    DefaultAllGather.__call__ = counting
    return build()
