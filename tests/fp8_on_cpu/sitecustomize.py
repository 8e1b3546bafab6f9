"""fp8 on CPU ranks, for tests/system/test_fp8_on_cpu.py and benchmarks/gpu_run.py's rehearsal: this directory
on PYTHONPATH makes every Python process of a launch (launcher, fork server, ranks) import this file first.

ddp-amp refuses fp8 on CPU ranks (torch's CPU `_scaled_mm` emulates it, slowly); the refusal is lifted here, so
that the fp8 training path runs as it would on a GPU."""

import importlib
import importlib.abc
import importlib.util
import os
import sys

import ddp_amp.precision

ddp_amp.precision.fp8_refusal = lambda *args, **kwargs: None


ONEDNN_OFF = "DDP_AMP_TEST_FP8_ONEDNN_OFF"
"""Set by an fp8 launch's launcher, for its fork server and ranks."""


class OneDNNOffOnceTorchLoads(importlib.abc.MetaPathFinder):
    # On a CPU with AMX, torch's CPU _scaled_mm runs oneDNN's reference kernel (about 1 s for one 256^3 matmul,
    # ~500x its emulation elsewhere): an fp8 launch would not end in minutes. With oneDNN off, torch emulates fp8
    # everywhere alike. Set where torch is first imported, so that the fork server's ranks inherit it. Only in an
    # fp8 launch: without oneDNN, bf16's matmuls run ~30x slower there.
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_turn_off(module):
            exec_module(module)
            importlib.import_module("torch.backends.mkldnn").enabled = False

        spec.loader.exec_module = exec_then_turn_off
        return spec


if any(arg.startswith("--dtype=fp8") for arg in sys.argv) or any(
        flag == "--dtype" and value.startswith("fp8") for flag, value in zip(sys.argv, sys.argv[1:])):  # or rowwise
    os.environ[ONEDNN_OFF] = "1"
if os.environ.get(ONEDNN_OFF):
    sys.meta_path.insert(0, OneDNNOffOnceTorchLoads())
