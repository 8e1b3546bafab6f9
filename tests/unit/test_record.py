"""summary.json's one typed view (outputs.RunRecord): its readers name no key of it elsewhere, each key it reads
is one the ranks write, and its verdicts read the record as the launcher needs them."""

import ast
import re
from pathlib import Path

from ddp_amp.outputs import RunRecord

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddp_amp"


def _keys_read() -> list[str]:
    """The keys RunRecord reads: its attributes read straight from the record (_Key) and those its properties
    read (self.raw.get("key"))."""
    from ddp_amp.outputs import _Key

    keys = [name for name, value in vars(RunRecord).items() if isinstance(value, _Key)]
    tree = ast.parse((PACKAGE / "outputs.py").read_text())
    record = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "RunRecord")
    for call in ast.walk(record):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "get" and call.args and \
                isinstance(call.args[0], ast.Constant):
            keys.append(call.args[0].value)
    return keys


def test_every_key_the_record_reads_is_one_a_writer_writes():
    """A key misspelt here would read as None forever: each must appear as a string in a module that writes the
    summary (outputs.py itself excluded)."""
    written = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py") if path.name != "outputs.py")
    keys = _keys_read()
    assert len(keys) > 30 and "diverged" in keys and "stopped_at_step" in keys
    missing = [key for key in keys if not re.search(rf"""["']{key}["']|\b{key}=""", written)]
    assert not missing, missing


def test_no_module_but_the_records_reads_summary_json_by_key():
    """summary.json is read as a RunRecord: no `summary["key"]` or `summary.get("key")` read elsewhere (writes,
    `summary["key"] = value`, build it)."""
    reads = []
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""summary(\.get\(|\[)["'][a-z_]+["'](?!\]\s*=[^=])""", line):
                reads.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not reads, reads


def test_the_records_verdicts():
    assert not RunRecord({}) and RunRecord({}).failure("r") is None and RunRecord({}).restarts == 0
    stopped = RunRecord({"stopped_at_step": 4, "stopped_by": "SIGTERM", "checkpoint": "c"})
    assert not stopped.finished and stopped.failure("r") is None
    diverged = RunRecord({"diverged": {"step": 7, "rank": 1, "reason": "loss inf"}, "checkpoint": "ck"})
    assert not diverged.finished
    assert diverged.failure("r") == ("training diverged at step 7 on rank 1: loss inf; no model.pt written (see "
                                     "--max-nonfinite); the newest finite checkpoint is ck (--resume ck)")
    assert RunRecord({"eval_error": "boom"}).failure("r").startswith("boom (the trained weights are in r/model.pt")
    assert RunRecord({"model_path": "m", "steps": 3}).finished
