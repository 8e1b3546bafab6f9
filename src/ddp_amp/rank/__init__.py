"""What a rank does around the training core: `setup` (device, threads, NCCL environment, precision agreement,
seeding, task checks), `signals` (the stop request), `heartbeat`, `evaluation` and `reporter` (events to the
launcher, metrics.jsonl, TensorBoard). ddp_amp.worker is the entry that puts them together."""
