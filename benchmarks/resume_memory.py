"""Peak host memory of a rank choosing the checkpoint to resume from, this tree against an earlier revision.

    .venv/bin/python benchmarks/resume_memory.py [--base REV] [--keep 3] [--repeats 3]

Without --base, this tree alone.

One run of the wide MLP (1024-4096-1024-1024, AdamW: ~113 MB a checkpoint) leaves --keep checkpoints; then,
in a fresh process per measurement, what every rank of a `--resume` launch does at start-up: find the newest
checkpoint this launch may continue from (none of this launch's yet), then load --resume's. Reported: the
process's peak RSS (ru_maxrss) over what it held after its imports, interleaved, medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from against_revision import export_src
from common import spread

HERE = Path(__file__).parent
MEASURE = """
import json, resource, sys, time
from pathlib import Path
from ddp_amp.config import TrainConfig
try:
    from ddp_amp.checkpoint.manager import checkpoint_to_continue
except ImportError:  # before the checkpoint package
    from ddp_amp.worker import _checkpoint_to_continue as checkpoint_to_continue
run_dir, resume = Path(sys.argv[1]), sys.argv[2]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
config = TrainConfig(run_dir=str(run_dir), launch_time=time.time(), resume=resume)
path, state = checkpoint_to_continue(config, run_dir)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"path": str(path), "extra_mb": (after - before) / 1024}))
"""


def measure(src: Path, run_dir: Path, resume: Path) -> float:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(run_dir), str(resume)], check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)}).stdout
    return json.loads(out.splitlines()[-1])["extra_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="an earlier revision to compare with (git rev)")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "1", "--device", "cpu", "--task",
                        f"{HERE / 'tasks.py'}:wide_regression", "--batch-size", "8", "--steps", str(args.keep),
                        "--checkpoint-every", "1", "--keep", str(args.keep), "--quiet", "--run-dir", str(run_dir)],
                       check=True, capture_output=True)
        newest = run_dir / "checkpoints" / f"step-{args.keep}.pt"
        size_mb = newest.stat().st_size / 2**20
        sides = {"this tree": HERE.parent / "src"}
        if args.base:
            sides[args.base] = export_src(args.base, Path(tmp))
        results: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, src in sides.items():
                results[name].append(measure(src, run_dir, newest))
    print(f"{args.keep} checkpoints of {size_mb:.0f} MB each; peak RSS added while choosing and loading one to "
          f"resume, MB, median [min-max] over {args.repeats}:")
    for name, values in results.items():
        print(f"  {name:<10} {spread(values, '.0f')}  ({statistics.median(values) / size_mb:.1f} checkpoints' worth)")


if __name__ == "__main__":
    main()
