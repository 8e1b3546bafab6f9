"""ddp-amp: launch PyTorch DistributedDataParallel training with automatic mixed precision."""

__version__ = "0.1.0"
