"""ddp_amp.loop: what ddp-amp's own training loop does, as a handful of calls in a script's own loop.

    from ddp_amp import loop

    run = loop.setup()                                   # process group, device, precision, stop signals
    model, optimizer = run.prepare(model, optimizer)     # DDP, ZeRO-1 or FSDP2 (--shard); schedulers after it
    data = run.loader(dataset, batch_size=32)            # this rank's share of each epoch, resumable
    for step in run.steps(total, model=model, optimizer=optimizer, scheduler=scheduler, data=data):
        for inputs, targets in run.accumulate(model, data):   # --grad-accum batches; all-reduced on the last
            with run.autocast():
                loss = loss_fn(model(inputs), targets)
            run.backward(loss)                           # scaled for fp16, divided by --grad-accum
        run.step(optimizer, scheduler)                   # unscale, --clip-grad, step; both skipped on an overflow
        run.log(loss=loss)                               # metrics.jsonl and the live view, every --log-every
    run.finish(model=model)                              # model.pt (unless stopped), loop.json

steps() does the cadence work after each step: it reports the step's logged metrics, saves every
--checkpoint-every steps, and ends the loop on every rank at one step once a stop signal arrived (saved there);
given the state to checkpoint, it first resumes it (--resume, or a restart) and starts from the step after.

Settings (`--amp`, `--dtype`, `--grad-accum`, `--clip-grad`, `--shard`, `--checkpoint-every`, `--keep`,
`--checkpoint-format`, `--async-checkpoint`, `--resume`, `--log-every`, `--seed`, `--device`, `--tensorboard`,
`--tracker`...) come from the ddp-amp command line before the script, over the defaults the script passes to
setup(). Under plain torchrun, and as a single `python script.py` (world size 1), the same calls do the obvious:
one process group of one, no launcher to report to. The calls of earlier versions (restore, report,
checkpoint_due, save, should_stop, full_state_dict) still work: docs/scripts.md.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.config import TrainConfig
from ddp_amp.dist import KEPT_GROUPS, DistEnv, join_process_group, resolve_device
from ddp_amp.loop.checkpoints import LoopCheckpoints, UnfinishedCheck
from ddp_amp.loop.progress import Progress
from ddp_amp.loop.settings import LoopError, LoopSettings
from ddp_amp.parallel import strategy_for
from ddp_amp.precision import autocast
from ddp_amp.rank.signals import STOP_REQUEST, stop_on_signals
from ddp_amp.train.data import RankData
from ddp_amp.train.stop import StopAgreement
from ddp_amp.train.update import OptimizerUpdate

RankLoader = RankData
"""What loader() returns (the name of earlier versions): train.data.RankData, ddp-amp's own data position."""

__all__ = ["Loop", "LoopError", "RankData", "RankLoader", "setup"]


def setup(**defaults: Any) -> Loop:
    """The loop of this process: joins the process group of torchrun's environment contract (RANK, WORLD_SIZE,
    MASTER_ADDR, ...; without it a group of one), picks the device and the precision, and turns the stop signals
    into a stop request that should_stop() agrees on. `defaults`: the script's own settings, which the ddp-amp
    command line overrides."""
    settings = LoopSettings.resolve(defaults)
    settings.check_run_dir()
    return Loop(settings)


class Loop:
    def __init__(self, settings: LoopSettings) -> None:
        self.settings = settings
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if settings.device != "cpu" and torch.cuda.is_available() and self.local_rank >= torch.cuda.device_count():
            raise LoopError(f"setup(): local rank {self.local_rank} and {torch.cuda.device_count()} GPU(s) on this "
                            "node (a GPU per rank); start as many ranks per node as it has GPUs, or pass --device cpu")
        self.device = resolve_device(settings.device, self.local_rank)
        self._own_group = join_process_group(self.device)
        self._amp = settings.precision(self.device)
        self.precision = self._amp.name
        """The autocast dtype ("bf16", "fp16") or "fp32"."""
        config = TrainConfig(shard=settings.shard, compile=False)
        self.strategy = strategy_for(config, self.device)
        self.scaler = self.strategy.grad_scaler(self._amp)
        self.grad_accum, self.clip_grad = settings.grad_accum, settings.clip_grad
        self.run_dir = Path(settings.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        stop_on_signals()
        self._stop = StopAgreement(lambda: STOP_REQUEST.signum)
        self.stopped_by: int | None = None
        """The stop signal the ranks agreed on (its number), once should_stop() said so."""
        self.stopped_at: int | None = None
        self.completed_steps: int | None = None
        """steps()' total, once its loop ran every step (a launcher's stop after that finds the loop finished)."""
        self.model_path: Path | None = None  # rank 0: the model.pt finish() wrote
        self._modules: dict[int, torch.nn.Module] = {}
        """id(what prepare returned) -> the model inside it (what a checkpoint holds)."""
        self._prepared: list[torch.nn.Module] = []  # what prepare returned, in order
        self._optimizers: list[torch.optim.Optimizer] = []
        self._owner: dict[int, torch.nn.Module] = {}
        """id(optimizer) -> the model it trains (prepare's)."""
        self._backwards: dict[int, int] = {}
        """id(model) -> backward passes since its optimizer's last step."""
        self._sync_chosen: set[int] = set()
        """id(model) whose current forward and backward run where the run chose to reduce or not: inside
        accumulate(model), or after autocast(model)."""
        self._updates: dict[int, OptimizerUpdate] = {}  # id(optimizer) -> its update (train.update's)
        self.skipped_steps = 0
        self._logged: dict[str, Any] = {}  # log()'s metrics of the step in progress: steps() reports them after it
        self._checkpoints = LoopCheckpoints(self)
        self._progress = Progress(self)
        self._finished = False
        self._unfinished = UnfinishedCheck(self._checkpoints.manager, self.rank, settings.under_ddp_amp)

    def prepare(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """`model` moved to this rank's device and wrapped for the run's parallel mode, and each of `optimizers`
        (built over `model`'s parameters) made to train the wrapped model: (model, *optimizers), or the model alone.
        Build the schedulers after this, on the optimizers it returns."""
        names = {id(p): name for name, p in model.named_parameters()}
        groups = [[(names.get(id(p)), p) for p in group["params"]] for opt in optimizers for group in opt.param_groups]
        if any(name is None for group in groups for name, _ in group):
            raise LoopError("prepare(): an optimizer trains parameters that are not the model's; prepare each model "
                            "with the optimizers of its own parameters")
        if not any(p.requires_grad for p in model.parameters()):  # DDP and FSDP2 refuse it, in their own words
            raise LoopError("prepare(): the model has no parameter to train (every one frozen, or none); a model "
                            "that only runs forward needs no prepare(): move it with .to(run.device)")
        if self.scaler.is_enabled() and any(opt.defaults.get("fused") for opt in optimizers):
            # A fused optimizer takes the scaler's overflow flag itself and is stepped even when it skips: the
            # skip would be seen only through a host sync every step.
            raise LoopError("prepare(): a fused optimizer under fp16's gradient scaler; build it with foreach=True")
        module = model.to(self.device)
        wrapped = self.strategy.setup_module(module)
        self._modules[id(wrapped)] = module
        self._prepared.append(wrapped)
        prepared = [self._rebuilt(module, optimizer, names) for optimizer in optimizers]
        for optimizer in prepared:
            self._optimizers.append(optimizer)
            self._owner[id(optimizer)] = wrapped
            self._updates[id(optimizer)] = OptimizerUpdate(optimizer, self.scaler, self.strategy,
                                                           clip_grad=self.clip_grad)
        return (wrapped, *prepared) if prepared else wrapped

    def _rebuilt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 names: dict[int, str]) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model's parameters, as the parallel mode runs it: itself under DDP;
        rebuilt over the sharded parameters (FSDP2), or as a ZeroRedundancyOptimizer (ZeRO-1), from its class,
        its defaults and its groups. `names`: id(parameter) -> its name, taken before the model was wrapped."""
        params = dict(module.named_parameters())
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [params[names[id(p)]] for p in group["params"]]} for group in optimizer.param_groups]
        same = all(new is old for group, old_group in zip(groups, optimizer.param_groups)
                   for new, old in zip(group["params"], old_group["params"]))
        if same and self.strategy.mode == "none":
            return optimizer
        if optimizer.state:
            raise LoopError("prepare(): the optimizer has taken steps already; prepare it before training")
        if len(groups) > 1 and self.strategy.mode == "optimizer":
            raise LoopError("prepare(): --shard optimizer takes an optimizer with one parameter group")
        cls = type(optimizer)
        # What its constructor takes: defaults can hold keys it does not (AdamW's decoupled_weight_decay).
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        options = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        if self.strategy.mode == "optimizer":  # one group: its own settings over the defaults
            own = {k: v for k, v in groups[0].items() if k in accepted}
            return self.strategy.build_optimizer(groups[0]["params"], cls, {**options, **own})
        return cls(groups, **options)

    def autocast(self, model: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """The forward and the loss under the run's precision (a no-op context in fp32). Inside accumulate(), or
        with one micro-step, that is all. Given the `model` whose forward it holds (the call of earlier
        versions), it also chooses the reduction as accumulate() does: every micro-step's forward but the
        --grad-accum-th runs under the model's no_sync."""
        precision = autocast(self._amp, self.device.type)
        if model is None or self.grad_accum == 1:
            return precision
        wrapped = self._the_model(model, "autocast")
        self._sync_chosen.add(id(wrapped))
        if self._backwards.get(id(wrapped), 0) + 1 == self.grad_accum:
            return precision
        stack = contextlib.ExitStack()
        stack.enter_context(self.strategy.no_sync(wrapped))
        stack.enter_context(precision)
        return stack

    def accumulate(self, model: torch.nn.Module, data: Any = None) -> Iterator[Any]:
        """The --grad-accum micro-steps of `model`'s next optimizer step: each micro-step's forward and
        backward (the loop body) run under the model's no_sync but the last's, whose backward all-reduces the
        accumulated gradients once (Fabric's no_backward_sync, chosen for you). Yields the next batch of
        `data` (loader()'s, or any iterator) for each, or the micro-step's index without it."""
        wrapped = self._the_model(model, "accumulate")
        if data is not None and not isinstance(data, RankData) and not hasattr(data, "__next__"):
            raise LoopError(f"accumulate(): data={type(data).__name__} is neither loader()'s nor an iterator; pass "
                            "loader()'s, or iter(...) of yours")
        for index in range(self.grad_accum):
            last = index == self.grad_accum - 1
            try:
                batch = index if data is None else data.next_batch() if isinstance(data, RankData) else next(data)
            except StopIteration:
                raise LoopError(f"accumulate(): the data ran out after {index} of {self.grad_accum} micro-steps") \
                    from None
            with self.strategy.no_backward_sync(wrapped, enabled=not last):
                self._sync_chosen.add(id(wrapped))
                try:
                    yield batch
                finally:
                    self._sync_chosen.discard(id(wrapped))

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None = None) -> None:
        """The backward of `loss` / --grad-accum, scaled for fp16. With --grad-accum K, the K-th call for `model`
        since its optimizer's last step reduces the gradients across ranks; the others do not (under
        accumulate(), or after autocast(model)); anywhere else with K > 1 it is refused, since every
        micro-step would all-reduce."""
        model = self._the_model(model, "backward")
        count = self._backwards.get(id(model), 0) + 1
        if count > self.grad_accum:
            raise LoopError(f"backward(): {count} backward passes of one model before its step, with --grad-accum "
                            f"{self.grad_accum}; call step() after every {self.grad_accum}")
        if self.grad_accum > 1 and id(model) not in self._sync_chosen:
            raise LoopError(f"backward(): with --grad-accum {self.grad_accum}, run each micro-step inside "
                            "`for batch in run.accumulate(model, data):` (only the last all-reduces the gradients)")
        self._backwards[id(model)] = count
        scaled = self.scaler.scale(loss if self.grad_accum == 1 else loss / self.grad_accum)
        # The backward too: FSDP2 decides its reduce-scatter in the backward, DDP in the forward.
        with self.strategy.no_backward_sync(model, enabled=count < self.grad_accum):
            scaled.backward()

    def step(self, optimizer: torch.optim.Optimizer, *schedulers: Any, clip_grad: float | None = None) -> bool:
        """One optimizer step, the core's (train.update): unscale, clip to `clip_grad` (else --clip-grad), step
        through the gradient scaler, and the schedulers stepped only when the optimizer was (fp16 skips a step
        whose gradients overflowed, and its schedule must not advance either); the gradients zeroed. No host
        sync of its own. Whether the optimizer stepped."""
        if id(optimizer) not in self._owner:
            raise LoopError("step(): an optimizer that prepare() did not return; use the one it returned")
        model = self._owner[id(optimizer)]
        done = self._backwards.get(id(model), 0)
        if done != self.grad_accum:
            raise LoopError(f"step(): after {done} backward pass{'es' if done != 1 else ''} of its model, and "
                            f"--grad-accum is {self.grad_accum}: the gradients are not reduced yet")
        self._backwards[id(model)] = 0
        self._sync_chosen.discard(id(model))
        update = self._updates[id(optimizer)]
        update.schedulers = list(schedulers)
        stepped, _ = update(clip_grad=clip_grad)
        if not stepped:
            self.skipped_steps += 1
        return stepped

    def _the_model(self, model: torch.nn.Module | None, call: str) -> torch.nn.Module:
        if model is None:
            if len(self._prepared) != 1:
                raise LoopError(f"{call}(): {len(self._prepared)} models were prepared; name the one whose loss "
                                f"this is: {call}(loss, model)" if self._prepared else
                                f"{call}(): no model was prepared; call prepare(model, optimizer) first")
            return self._prepared[0]
        if id(model) not in self._modules:
            raise LoopError(f"{call}(): a model that prepare() did not return; use the one it returned")
        return model

    def loader(self, dataset: Any, batch_size: int, *, shuffle: bool = True, num_workers: int = 0,
               collate_fn: Any = None, **loader_options: Any) -> RankData:
        """This rank's batches of `dataset` (map-style), `batch_size` per rank, reshuffled every epoch by
        --seed (ddp-amp's own data position, train.data: padded to whole batches on every rank, and on another
        world size each remaining sample of the epoch once). Iterating it gives the rest of the epoch; give it
        to steps() or restore() so that a resumed run continues with the next batch (loader_options:
        DataLoader's)."""
        try:
            size = len(dataset)
        except TypeError:
            raise LoopError("loader(): the data set has no len(): give a map-style data set (an iterable one "
                            "shards and resumes as its own code says)") from None
        if size == 0:
            raise LoopError("loader(): the data set is empty")
        env = DistEnv(self.rank, self.local_rank, self.world_size, 1, "", 0)
        return RankData(dataset, env, self.device, batch_size=batch_size, seed=self.settings.seed,
                        workers=num_workers, collate_fn=collate_fn, shuffle=shuffle, on_device=True,
                        **loader_options)

    def steps(self, total: int, **state: Any) -> Iterator[int]:
        """The optimizer steps to take, 0-based, up to `total`: from 0, or given the `state` a checkpoint holds
        (what restore() takes; or after restore() was called), from where --resume or a restart left it. After
        each step it does the cadence work: reports what log() was given, saves every --checkpoint-every steps,
        and ends the loop on every rank at one step once a stop signal arrived (saved there)."""
        if not state and self._checkpoints.parts is None:
            self._check_nothing_asked_of_state()
        start = self.restore(**state) if state else self._checkpoints.resumed_from_step or 0
        for step in range(start, total):
            yield step
            done = step + 1
            logged, self._logged = self._logged, {}
            self._progress.report(done, logged, last=done == total)  # the last step logged, as the core logs it
            if self.checkpoint_due(done) and self._checkpoints.parts is not None:
                self.save(done)
            # A stop agreed at the last step changes nothing, as in ddp-amp's own loop: the loop ends there and
            # finish() writes model.pt (a stop would leave a checkpoint with no step left to resume).
            if done < total and self.should_stop(done):
                return
        self.completed_steps = total
        self._progress.loop_ended(completed_steps=total)

    def _check_nothing_asked_of_state(self) -> None:
        """steps() with no state registered: refused where a setting needs it (the checkpoints would not be
        written, the resume would start over from step 0 beside the earlier run's metrics), not silently run."""
        every, resume = self.settings.checkpoint_every, self.settings.resume
        asked = f"--resume {resume}" if resume is not None else f"--checkpoint-every {every}" if every else None
        if asked:
            raise LoopError(f"steps(): {asked} and no state to {'resume' if resume is not None else 'checkpoint'}; "
                            "give steps() the state by name (steps(total, model=model, optimizer=optimizer, ...)), "
                            "or call restore(...) before it")

    def log(self, **metrics: Any) -> None:
        """Metrics of the step in progress (numbers or one-element tensors), reported by steps() after it."""
        self._logged.update(metrics)

    def restore(self, **state: Any) -> int:
        """Register what a checkpoint holds (models and optimizers as prepare() returned them, schedulers, the
        loader, anything with state_dict/load_state_dict) and, under --resume (or a restart), load it from the
        checkpoint: the optimizer step to continue from (0 for a fresh start)."""
        return self._checkpoints.restore(state)

    def checkpoint_due(self, step: int) -> bool:
        """--checkpoint-every N: whether optimizer step `step` is one to save at (the core's rule)."""
        return self._checkpoints.manager.due(step)

    def save(self, step: int) -> Path | None:
        """Every rank: a checkpoint of the state restore() (or steps()) registered after optimizer step `step`
        (every rank's random state included), in --checkpoint-format, written in the background unless
        --no-async-checkpoint (the loop waits only for the copy to host memory), the newest --keep kept; none
        when the state holds inf/NaN (a warning; the last good checkpoint stays). steps() calls it itself. The
        path it is written to, on rank 0 (None elsewhere)."""
        return self._checkpoints.save(step)

    def should_stop(self, step: int) -> bool:
        """Call after every optimizer step `step`, on every rank: True on every rank at the same step once any rank
        received a stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1), by then saved there (restore() registered what).
        Costs no collective per step (an asynchronous flag about every 0.25 s of steps)."""
        if self.stopped_at is not None:
            return True
        signum = self._stop.agreed(step)
        if not signum:
            return False
        self.stopped_at, self.stopped_by = step, signum
        self._progress.loop_ended(stopped_at_step=step, stopped_by=signum)
        if self._checkpoints.parts is not None and self._checkpoints.last_step != step:
            self.save(step)
        return True

    def report(self, step: int, **metrics: Any) -> None:
        """This rank's metrics at `step` (numbers or one-element tensors): every --log-every steps, rank 0 appends
        them to metrics.jsonl and each rank shows them in ddp-amp's live view."""
        self._progress.report(step, metrics)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Every rank: the whole model's state_dict (sharded weights gathered) on rank 0, None on the others."""
        module = self._modules.get(id(model))
        if module is None:
            raise LoopError("full_state_dict(): a model that prepare() did not return")
        return self.strategy.model_state(module, [0])

    def finish(self, **models: torch.nn.Module) -> None:
        """At the end, every rank: the checkpoint write in flight finished; given the trained `models` by name,
        rank 0 writes their whole weights to RUN_DIR/model.pt, unless the loop was stopped (one model: its
        state_dict; several: {name: state_dict}); the loop's record written (loop.json); the stop signals given
        back their default actions (what follows the loop is interrupted as usual); the process group left when
        setup() joined it."""
        import signal

        from ddp_amp.outputs import save_weights
        from ddp_amp.process import STOP_SIGNALS

        if self._finished:  # its process group is gone: the second call would fail in a collective, unnamed
            raise LoopError("finish(): called a second time; call it once, after the loop")
        self._finished = True
        self._unfinished.cancel()
        self._checkpoints.close()
        if models and self.stopped_at is None:
            weights = {name: self.full_state_dict(model) for name, model in models.items()}
            if self.rank == 0:
                self.model_path = save_weights(self.run_dir, weights if len(weights) > 1 else
                                               next(iter(weights.values())))
        self._progress.finish()
        self._stop.close()
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        dist.barrier()  # every rank's last collective is complete
        if self._own_group and dist.is_initialized():
            # The script still holds its DDP models, which hold the group: kept referenced here, it is never
            # destructed in the middle of the script's code, where gloo's destructor can hang (docs/scripts.md).
            KEPT_GROUPS.append(dist.group.WORLD)
            dist.destroy_process_group()

