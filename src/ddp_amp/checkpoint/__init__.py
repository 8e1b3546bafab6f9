"""Training checkpoints: `storage` (the file, finding the newest valid one, pruning, mismatch checks, RNG
states) and `manager` (when to save, the copy to host, the background write, and resume agreement)."""
