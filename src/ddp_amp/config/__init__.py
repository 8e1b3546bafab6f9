"""The run configuration: one typed, validated object shared by the CLI, every launcher and every rank. It
imports nothing heavy, so the CLI can build and validate it before torch is loaded."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Literal

from ddp_amp.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")
AMP_MODES = ("auto", "on", "off")
DTYPES = ("auto", "bf16", "fp16", "bf16-true", "fp8", "fp8-rowwise")
TRACKERS = ("mlflow", "wandb")
SCHEDULES = ("constant", "cosine", "exponential", "step", "onecycle")
OPTIMIZERS = ("adamw", "sgd")
TF32_MODES = ("on", "off")
FLUSH_DENORMAL_MODES = ("auto", "on", "off")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop", "compiled")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16")
SHARD_MODES = ("none", "optimizer", "full")
CHECKPOINT_FORMATS = ("single", "sharded")
DEFAULT_STEPS = 100
INT64_MAX = 2**63 - 1  # the largest integer option: torch holds them (the seed, step counts) as int64
MAX_SECONDS = 1e9  # the longest --timeout and --stop-timeout: a timedelta and c10d's milliseconds hold it
CHOICES = {"device": DEVICES, "amp": AMP_MODES, "dtype": DTYPES, "tracker": TRACKERS, "schedule": SCHEDULES,
           "optimizer": OPTIMIZERS, "tf32": TF32_MODES, "flush_denormal": FLUSH_DENORMAL_MODES,
           "optimizer_impl": OPTIMIZER_IMPLS, "grad_compression": GRAD_COMPRESSIONS, "shard": SHARD_MODES,
           "checkpoint_format": CHECKPOINT_FORMATS}
"""The fields whose values are one of a few names: the command line offers (and completes) exactly these."""
JobKind = Literal["train", "bench", "max-batch", "doctor"]
"""What the ranks do with the config: train (spawn, run, multinode); train timing every step, the device synchronised
(bench); search the largest batch that trains (bench --max-batch); measure ranks and links (doctor)."""
JOB_KINDS: tuple[str, ...] = JobKind.__args__
NOT_OPTIONS = ("run_dir", "launch_time", "elastic", "job_id")
"""Fields set by the launchers, not by training flags (--run-dir is an output option of its own)."""


def parse_window(text: str) -> tuple[int, int]:
    """"START:END" -> (START, END): optimizer steps, counted from 1, both included."""
    start, sep, end = text.partition(":")
    try:
        window = (int(start), int(end))
    except ValueError:
        raise ValueError(f"--profile {text!r} is not START:END (optimizer steps, e.g. 10:20)") from None
    if not sep or not 1 <= window[0] <= window[1]:
        raise ValueError(f"--profile {text!r}: need 1 <= START <= END")
    return window


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a rank needs to train. Validated on construction; every problem is reported at once."""

    task: str = "mlp"
    """A built-in task (linear, mlp, mlp-wide, transformer, gpt) or `module:factory` / `path/to/file.py:factory`."""
    task_arg: tuple[str, ...] = ()
    """KEY=VALUE, repeatable: an argument of the --task factory, converted by its annotation (int, bool, Path...)."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu or cuda. CUDA ranks use nccl, CPU ranks gloo."""
    amp: str = "auto"
    """Mixed precision: auto (on GPUs bf16 where native, else fp16; on CPU ranks whichever of fp32, bf16 and
    bf16-true trains the task fastest, measured at start-up), on, or off (fp32)."""
    dtype: str = "auto"
    """Autocast dtype when AMP is on: auto, bf16 or fp16 (with a GradScaler); bf16-true: bf16 weights too, the
    optimizer updating fp32 masters; fp8 / fp8-rowwise: torchao's float8 layers (GPUs of compute capability 8.9+)."""
    optimizer: str = "adamw"
    """adamw or sgd (with --momentum)."""
    lr: float = 3e-3
    """Peak learning rate."""
    momentum: float = 0.9
    """SGD momentum; ignored by adamw."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (sgd)."""
    schedule: str = "cosine"
    """LR schedule after warm-up, in optimizer steps: constant, cosine, exponential, step or onecycle."""
    warmup_steps: int = 0
    """Linear warm-up from lr/(warmup+1) to lr over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """Where cosine and exponential end, as a fraction of --lr."""
    batch_size: int = 32
    """Samples per rank per micro-step; the global batch is batch_size x world_size x grad_accum."""
    steps: int | None = None
    """Optimizer steps to train [default: 100, unless --epochs is given]."""
    epochs: int | None = None
    """Passes over the training set, as an alternative to --steps."""
    grad_accum: int = 1
    """Micro-steps accumulated per optimizer step; gradients are all-reduced only on the last."""
    micro_batch: str | None = None
    """Split each rank's --batch-size into micro-batches of N samples (gradients accumulated, the all-reduce
    once a step, each weighted by its share of the batch's samples, or of the global batch's tokens for a loss
    over tokens: the mathematics stay the full batch's); auto: start from the whole batch and halve it on every
    rank when any rank runs out of memory, rerunning the same batch. Validation batches are that size too."""
    max_memory: float | None = None
    """Cap each rank's memory at this many GB (CUDA: the caching allocator's share of the GPU; CPU: RLIMIT_DATA),
    to rehearse a smaller device or bound --micro-batch auto."""
    clip_grad: float | None = None
    """Clip the global gradient norm to this value (after unscaling under fp16)."""
    log_every: int = 10
    """Reduce metrics across ranks and log every this many optimizer steps."""
    seed: int = 0
    """Seed for model init, data order and data generation; same seed and world size give the same run."""
    run_dir: str = "runs/latest"
    """Where rank 0 writes model.pt, summary.json and metrics.jsonl."""
    launch_time: float = 0.0
    """time.time() when the launcher started; time_to_first_step_s is measured from it."""
    elastic: bool = False
    """An elastic multinode job (--nnodes MIN:MAX): the world size may change when torchrun restarts the workers,
    and they continue from the newest checkpoint across the change."""
    job_id: str | None = None
    """multinode: the rendezvous id, the same on every node of one job; a node that joins an elastic job later
    recognises the job's run dir by it (a shared file system) and joins instead of refusing it."""
    tf32: str | None = None
    """CUDA only: on or off to allow TF32 for fp32 matmuls and convolutions (None leaves torch's default)."""
    flush_denormal: str = "auto"
    """CPU ranks: on flushes subnormal floats (below 1.2e-38) to zero, which CPUs otherwise compute on a path
    many times slower (torch.set_flush_denormal); auto: on for CPU ranks. Numerics change only below 1.2e-38."""
    eval_every: int = 0
    """Evaluate Task.val_dataset every this many optimizer steps, and at the end (0: at the end only); every rank
    a disjoint share, each sample counted once."""
    keep_best: str | None = None
    """METRIC[:min|max] (a val_ name; min for a loss, else max, unless given): RUN_DIR/model_best.pt holds the
    weights of the best evaluation, and that step's checkpoint is never pruned."""
    checkpoint_every: int = 0
    """Write RUN_DIR/checkpoints/step-<N>.pt every this many optimizer steps (0: never)."""
    keep: int = 2
    """How many of the newest checkpoints to keep."""
    async_checkpoint: bool = True
    """Write each checkpoint from a background thread: the loop waits only while the state is copied to host
    memory (and for the previous write, if it is still going; at most one is in flight). Off, the loop writes
    it itself. The stop checkpoint is always complete before the run exits."""
    checkpoint_format: str = "single"
    """single: each checkpoint one file, step-<N>.pt, gathered whole on rank 0 and written by it; sharded: a
    torch.distributed.checkpoint directory, step-<N>/, every rank writing its own part (needs a run directory
    every node shares). Either resumes at any world size, and either format resumes a run of the other."""
    init_from: str | None = None
    """Initial weights before training: a state_dict file (.pt/.bin), a .safetensors file, a directory written by
    save_pretrained, a ddp-amp model.pt or checkpoint (its model). A --resume checkpoint wins over it."""
    init_strict: bool = True
    """--init-from must fill every tensor of the model and hold no other; --no-init-strict loads the matching ones
    and reports how many were missing and unexpected."""
    resume: str | None = None
    """A checkpoint to continue from: a path, or "auto" for the run dir's newest valid one (the launcher
    resolves "auto" to a path before any rank starts)."""
    stop_timeout: float = 60.0
    """After a stop signal, how long the ranks get to agree on a step, write its checkpoint and exit before they
    are killed."""
    timeout: float = 300.0
    """Seconds a collective may wait for the other ranks before the run fails. 300: longer than any solo work
    between two collectives (rank 0 writing a checkpoint of several GB), short enough that a hung rank costs
    minutes, not torch's 10-30; the live view marks the stuck rank `stalled` long before."""
    max_nonfinite: int = 20
    """Stop the run (exit 1) once the loss has been inf/NaN for this many consecutive optimizer steps on any
    rank, or GradScaler has skipped this many in a row (the fp16 loss scale collapsed); 0 never stops. 20 skips
    divide the scale by 10^6, far beyond its normal settling at the start of a run."""
    num_workers: int | None = None
    """DataLoader worker processes per rank (None: 0 on CPU ranks, a few per rank on CUDA); refused only where this
    node cannot start that many processes, warned of above its usable cores per rank (I/O-bound workers may be)."""
    optimizer_impl: str = "auto"
    """The optimizer's implementation: fused (one kernel for all parameters), foreach (per tensor list), loop (one
    parameter at a time, torch's CPU default), compiled (bf16-true's AdamW in one compiled pass that reads the bf16
    gradients and writes the bf16 weights; --shard none, CPU ranks); auto: fused, but foreach under fp16's
    GradScaler or SGD --shard full, compiled for AdamW under bf16-true with --compile and --shard none on CPUs
    where the parameters average a million elements (a step of many small tensors is slower compiled)."""
    grad_compression: str = "none"
    """Compress gradients for DDP's all-reduce with its built-in hook: none, fp16 or bf16 (bf16 needs nccl)."""
    shard: str = "none"
    """none: every rank keeps the whole optimizer state (DDP); optimizer: each rank keeps and updates the state of
    its share of the parameters and broadcasts them after the step (ZeRO-1, ZeroRedundancyOptimizer); full:
    parameters, gradients and optimizer state sharded across the ranks (FSDP2's fully_shard, per block)."""
    bucket_mb: float = 25.0
    """Size of DDP's gradient buckets in MB (DDP's bucket_cap_mb): an all-reduce starts when one is full."""
    bucket_view: bool = True
    """Gradients are views into DDP's all-reduce buckets (gradient_as_bucket_view): no copy in or out."""
    static_graph: bool = False
    """Tell DDP the set of used parameters never changes between steps (static_graph)."""
    find_unused_parameters: bool = False
    """DDP's find_unused_parameters: for a model that uses only some of its parameters in a step (a branch, a
    conditional head); it costs a traversal of the graph every step."""
    broadcast_buffers: bool = True
    """DDP's broadcast_buffers: rank 0's buffers (BatchNorm's running statistics) overwrite every rank's at each
    forward; off, each rank keeps its own, and model.pt holds rank 0's either way."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (batch statistics over every rank's batch); CUDA ranks only."""
    compile: bool = False
    """torch.compile the module DDP wraps (compiling the DDP wrapper captures no graph in this torch), or each
    FSDP unit before it is sharded under --shard full; the first steps pay for the compilation, reported as
    compile_s."""
    profile: str | None = None
    """Profile optimizer steps START:END (counted from 1, both included) with torch.profiler on every rank:
    RUN_DIR/profile/rank<N>.json.gz traces and the top operators; those steps are left out of the throughput."""
    tensorboard: bool = False
    """Global rank 0 writes the logged scalars (loss, LR, throughput, grad norm, loss scale, skipped steps) to
    RUN_DIR/tensorboard with torch.utils.tensorboard (needs the tensorboard package)."""
    tracker: tuple[str, ...] = ()
    """Experiment trackers global rank 0 logs to (repeatable): mlflow (where MLFLOW_TRACKING_URI says), wandb
    (WANDB_MODE=offline for no server; files under WANDB_DIR, else RUN_DIR/wandb). One tracker run per training run
    (its id in RUN_DIR/trackers.json: a resume, requeue or restart continues it, each step logged once); a tracker
    that fails is one warning line, and training goes on."""
    tracker_project: str | None = None
    """The MLflow experiment and W&B project [default: MLFLOW_EXPERIMENT_NAME or WANDB_PROJECT, else ddp-amp]."""
    tracker_run_name: str | None = None
    """The tracker run's name [default: the run directory's name]."""
    tracker_tag: tuple[str, ...] = ()
    """A tag of the tracker run (repeatable)."""

    def __post_init__(self) -> None:
        self.task_arg = tuple(self.task_arg or ())
        self.tracker = tuple(self.tracker or ())
        self.tracker_tag = tuple(self.tracker_tag or ())
        problems = [*self._choice_problems(), *self._optimization_problems(), *self._length_problems(),
                    *self._memory_problems(), *self._run_problems(), *self._shard_problems()]
        problems += [f"--{field.name.replace('_', '-')} must be at most {INT64_MAX}, got {value}"  # torch's int64
                     for field in dataclasses.fields(self) if type(value := getattr(self, field.name)) is int
                     and abs(value) > INT64_MAX]
        if problems:
            raise UsageError(*problems)
        if self.steps is None and self.epochs is None:
            self.steps = DEFAULT_STEPS

    def _choice_problems(self) -> list[str]:
        """The options whose value is one of a few names, and the combinations of them torch refuses."""
        problems = [f"{flag} {value!r} is not one of {', '.join(allowed)}" for flag, value, allowed in (
            ("--device", self.device, DEVICES), ("--amp", self.amp, AMP_MODES), ("--dtype", self.dtype, DTYPES),
            ("--schedule", self.schedule, SCHEDULES), ("--optimizer", self.optimizer, OPTIMIZERS),
            ("--optimizer-impl", self.optimizer_impl, OPTIMIZER_IMPLS),
            ("--grad-compression", self.grad_compression, GRAD_COMPRESSIONS), ("--shard", self.shard, SHARD_MODES),
            ("--checkpoint-format", self.checkpoint_format, CHECKPOINT_FORMATS),
            ("--flush-denormal", self.flush_denormal, FLUSH_DENORMAL_MODES)) if value not in allowed]
        if not 0 < self.bucket_mb <= 2**20:  # NaN fails too; beyond a TiB torch's byte count overflows
            problems.append(f"--bucket-mb must be a number of MB > 0 and <= 1048576, got {self.bucket_mb}")
        if self.static_graph and self.grad_accum > 1:
            # pytorch/pytorch#143580: DDP's static graph asserts on a first backward under no_sync, and the fix
            # proposed for it found that accumulation then stops all-reducing gradients after the first step.
            problems.append("--static-graph cannot be combined with --grad-accum > 1 in torch's DDP (its static "
                            "graph fails under no_sync); drop one of them")
        if self.profile is not None:
            try:
                start, end = parse_window(self.profile)
            except ValueError as exc:
                problems.append(str(exc))
            else:
                steps = self.steps if self.steps is not None else (DEFAULT_STEPS if self.epochs is None else None)
                if steps is not None and end > steps:
                    problems.append(f"--profile {self.profile}: the run has only {steps} steps")
        if self.static_graph and self.find_unused_parameters:
            problems.append("--static-graph and --find-unused-parameters are alternatives (a static graph finds "
                            "the unused parameters once, by itself); drop one of them")
        if self.tf32 is not None and self.tf32 not in TF32_MODES:
            problems.append(f"--tf32 {self.tf32!r} is not one of {', '.join(TF32_MODES)}")
        if self.amp == "off" and self.dtype != "auto":
            problems.append(f"--dtype {self.dtype} conflicts with --amp off (fp32); drop one of them")
        problems += [f"--tracker {name!r} is not one of {', '.join(TRACKERS)}" for name in self.tracker
                     if name not in TRACKERS]
        problems += [f"--tracker-tag {tag!r}: give it as KEY=VALUE" for tag in self.tracker_tag
                     if "=" not in tag or not tag.split("=", 1)[0]]
        tag_keys = [tag.split("=")[0] for tag in self.tracker_tag]
        for flag, given in (("--tracker", self.tracker), ("--tracker-tag", tag_keys)):  # as --task-arg refuses them
            problems += [f"{flag} {v} is given twice; give it once" for v in sorted(set(given)) if given.count(v) > 1]
        if (self.tracker_project or self.tracker_run_name or self.tracker_tag) and not self.tracker:
            problems.append("--tracker-project, --tracker-run-name and --tracker-tag need --tracker mlflow or wandb")
        if self.dtype == "bf16-true" and self.checkpoint_format == "sharded" and self.shard != "full":
            problems.append(f"--dtype bf16-true under --shard {self.shard} keeps its fp32 master weights beside the "
                            "model, where --checkpoint-format sharded does not look; use --checkpoint-format single, "
                            "or --shard full")
        return problems

    def _optimization_problems(self) -> list[str]:
        """The optimizer's and the schedule's numbers."""
        problems = []
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"--lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            problems.append(f"--momentum must be in [0, 1), got {self.momentum}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            problems.append(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            problems.append(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        elif self.schedule == "exponential" and self.min_lr_ratio == 0:
            problems.append("--min-lr-ratio must be > 0 for --schedule exponential (it decays towards it)")
        if self.clip_grad is not None and not (math.isfinite(self.clip_grad) and self.clip_grad > 0):
            problems.append(f"--clip-grad must be a finite number > 0, got {self.clip_grad}")
        return problems

    def _length_problems(self) -> list[str]:
        """How long the run is and how its steps are made up."""
        problems = [f"{flag} must be >= 1, got {value}" for flag, value in (
            ("--batch-size", self.batch_size), ("--grad-accum", self.grad_accum), ("--log-every", self.log_every))
            if value < 1]
        if self.steps is not None and self.epochs is not None:
            problems.append("--steps and --epochs are alternatives; give one of them")
        problems += [f"{flag} must be >= 1, got {value}" for flag, value in (("--steps", self.steps),
                                                                            ("--epochs", self.epochs))
                     if value is not None and value < 1]
        if self.warmup_steps < 0:
            problems.append(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        elif self.steps is not None and self.steps >= 1 and self.warmup_steps >= self.steps:
            problems.append(f"--warmup-steps ({self.warmup_steps}) must be smaller than --steps ({self.steps})")
        return problems

    def _run_problems(self) -> list[str]:
        """Timeouts, checkpoints, the divergence limit, data workers and the seed."""
        problems = []
        if not 1 <= self.timeout <= MAX_SECONDS:  # below a second c10d's own connects time out
            problems.append(f"--timeout must be a number of seconds from 1 to 1e9, got {self.timeout}")
        if self.keep < 1:
            problems.append(f"--keep must be >= 1, got {self.keep}")
        if not 0 < self.stop_timeout <= MAX_SECONDS:
            problems.append(f"--stop-timeout must be a number of seconds > 0 and <= 1e9, got {self.stop_timeout}")
        problems += [f"{flag} must be >= 0, got {value}" for flag, value in (
            ("--checkpoint-every", self.checkpoint_every), ("--max-nonfinite", self.max_nonfinite),
            ("--num-workers", self.num_workers), ("--seed", self.seed), ("--eval-every", self.eval_every))
            if value is not None and value < 0]
        if self.keep_best is not None:
            metric, _, mode = self.keep_best.partition(":")
            if not metric.startswith("val_") or mode not in ("", "min", "max"):
                problems.append(f"--keep-best {self.keep_best!r} is not METRIC[:min|max] with METRIC a val_ name "
                                "(val_loss, or val_<a name of Task.val_metrics>)")
        return problems

    def _memory_problems(self) -> list[str]:
        """--micro-batch and --max-memory."""
        problems = []
        if self.micro_batch is not None and self.micro_batch != "auto":
            try:
                micro = int(self.micro_batch)
            except ValueError:
                problems.append(f"--micro-batch must be auto or a number of samples, got {self.micro_batch!r}")
            else:
                if not 1 <= micro <= self.batch_size:
                    problems.append(f"--micro-batch must be between 1 and --batch-size ({self.batch_size}), "
                                    f"got {micro}")
        if self.micro_batch is not None and self.static_graph:
            problems.append("--static-graph cannot be combined with --micro-batch in torch's DDP (its static "
                            "graph fails under no_sync); drop one of them")
        if self.max_memory is not None and not (math.isfinite(self.max_memory) and self.max_memory > 0):
            problems.append(f"--max-memory must be a finite number of GB > 0, got {self.max_memory}")
        return problems

    def _shard_problems(self) -> list[str]:
        """The DDP options that have no meaning without DDP (--shard full trains without it)."""
        if self.shard != "full":
            return []
        ddp_only = [flag for flag, given in (
            ("--static-graph", self.static_graph), ("--find-unused-parameters", self.find_unused_parameters),
            (f"--grad-compression {self.grad_compression}", self.grad_compression != "none"),
            ("--sync-batchnorm", self.sync_batchnorm), (f"--bucket-mb {self.bucket_mb:g}", self.bucket_mb != 25.0),
            ("--no-bucket-view", not self.bucket_view), ("--no-broadcast-buffers", not self.broadcast_buffers))
            if given]
        problems = [f"{flag} is an option of DDP's, and --shard full trains without DDP (FSDP2 reduce-scatters "
                    f"the gradients); drop {flag.split()[0]} or use --shard none|optimizer" for flag in ddp_only]
        if self.micro_batch == "auto":
            problems.append("--micro-batch auto cannot be combined with --shard full yet (its search reduces "
                            "gradients the way DDP does); give --micro-batch a size, or use --shard none|optimizer")
        return problems

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls(**json.loads(text))

    def replace(self, **changes: object) -> TrainConfig:
        return dataclasses.replace(self, **changes)


CONFIG_FILE = "config.json"
