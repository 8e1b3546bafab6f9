"""How much further the batch grows under --shard full: `ddp-amp bench --max-batch` of the 25 M-parameter MLP
(AdamW, fp32) on 2 CPU ranks under a per-rank memory cap, --shard none and then full; the largest batch per
rank of each, their ratio, and the throughput at it. (A search is not timing: one run of each suffices.)

    .venv/bin/python benchmarks/max_batch_shard.py [--max-memory 1.2] [--shards none full]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-memory", type=float, default=1.2, help="GB per rank")
    parser.add_argument("--shards", nargs="+", default=["none", "full"], choices=["none", "optimizer", "full"])
    args = parser.parse_args()
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shard in args.shards:
            out = Path(tmp) / f"{shard}.json"
            subprocess.run([sys.executable, "-m", "ddp_amp", "bench", "--device", "cpu", "--amp", "off",
                            "--max-batch", "--task", f"{HERE / 'tasks.py'}:big_regression", "--max-memory",
                            str(args.max_memory), "--batch-size", "256", "--nproc", "2", "--shard", shard,
                            "--run-dir", str(Path(tmp) / shard), "--json", str(out)],
                           check=True, capture_output=True)
            found[shard] = json.loads(out.read_text())["max_batch"]["fp32"]
    first = args.shards[0]
    for shard, result in found.items():
        print(f"--shard {shard}: largest batch per rank {result['max_batch']} ({len(result['trials'])} trials, "
              f"{result['samples_per_s']:.0f} samples/s at it, peak {result['peak_memory_mb']:.0f} MB), "
              f"{result['max_batch'] / found[first]['max_batch']:.2f}x --shard {first}'s")


if __name__ == "__main__":
    main()
