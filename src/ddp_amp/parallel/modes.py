"""What the launcher knows of each parallel mode, without torch (parallel.base.Strategy is the rest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """What the launcher knows of a parallel mode without torch."""

    strategy: str
    """module:class of its strategy."""
    launch_words: str
    """Its words in the launch line ("" for plain DDP)."""
    one_size_per_launch: bool = False
    """bench --max-batch tries one batch size per launch: a pass holds collectives, so a size that runs out of
    memory on one rank cannot be retried by all of them in the same process group."""
    model_from_rank0: bool = False
    """A Task.model given as a function is built by rank 0 alone; the other ranks build it on the meta device
    and take rank 0's weights after wrapping."""
    libraries: tuple[str, ...] = ()
    """The torch.distributed modules it uses, imported before a rank's memory baseline (rank.setup)."""


MODES = {
    "none": Mode("ddp_amp.parallel.ddp:DDPStrategy", ""),
    "optimizer": Mode("ddp_amp.parallel.zero:ZeroStrategy", ", optimizer state sharded (ZeRO-1)",
                      libraries=("torch.distributed.optim",)),
    "full": Mode("ddp_amp.parallel.fsdp:FSDPStrategy", ", parameters, gradients and optimizer state sharded (FSDP2)",
                 one_size_per_launch=True, model_from_rank0=True,
                 libraries=("torch.distributed.fsdp", "torch.distributed.fsdp.sharded_grad_scaler",
                            "torch.distributed.checkpoint.state_dict")),
}
