"""How long a checkpoint blocks training: a 25 M-parameter MLP whose checkpoint (weights and AdamW's moments) is
about 300 MB, 2 CPU ranks, a save every few steps. Per launch, summary.json's mean seconds the loop was blocked
per save (gathering the state and copying it to host memory, and waiting for the previous write when it was
still going) against the background write's mean seconds (pickling, fsync, rename): a synchronous save would
block for both.

    .venv/bin/python benchmarks/checkpoint_blocking.py [--repeats 3] [--steps 40] [--every 20]
"""

import argparse
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    command = ["spawn", "-n", "2", "--device", "cpu", "--amp", "off", "--task", f"{HERE / 'tasks.py'}:big_regression",
               "--batch-size", "32", "--steps", str(args.steps), "--checkpoint-every", str(args.every), "--keep", "2",
               "--quiet"]
    runs, sizes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            run_dir = Path(tmp) / f"run-{repeat}"
            runs.append(run_ddp_amp(command, run_dir))
            sizes.append(max(p.stat().st_size for p in (run_dir / "checkpoints").glob("*.pt")) / 2**20)
    blocked = [r["checkpoint_blocked_s"] for r in runs]
    written = [r["checkpoint_write_s"] for r in runs]
    share = [b / (b + w) for b, w in zip(blocked, written)]
    print(f"checkpoint {spread(sizes, '.0f')} MB; the loop blocked {spread(blocked, '.3f')} s per save (most "
          f"{max(r['checkpoint_blocked_max_s'] for r in runs):.3f} s, {sum(r['checkpoint_waits'] for r in runs)} "
          f"waits for a previous write), the background write {spread(written, '.3f')} s")
    print(f"blocked / a synchronous save (blocked + write): {spread(share, '.3f')}")


if __name__ == "__main__":
    main()
