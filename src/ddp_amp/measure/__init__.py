"""The launcher's side of the commands that measure: bench's interleaved analysis, bench --max-batch, doctor's
judging, the GPUs' published peaks (MFU). Torch-free at import."""
