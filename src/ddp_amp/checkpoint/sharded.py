"""--checkpoint-format sharded: a checkpoint as a torch.distributed.checkpoint (DCP) directory, step-<N>/, that
every rank writes its own part of, and that any world size reads back (DCP reshards on load).

- The model and the optimizer are saved as each rank holds them (get_model_state_dict / get_optimizer_state_dict
  without gathering): under --shard full each rank's DTensor shards; under --shard optimizer the state of the
  parameters the rank owns (ZeroRedundancyOptimizer's local optimizer); under --shard none the replicated
  tensors, which DCP's planner spreads across the ranks so that each is written once. The optimizer state is
  flattened per parameter name (state.<name>.exp_avg, param_groups.<name>.lr), so a rank of another world
  size, owning other parameters, finds exactly its own.
- The rest (step, schedule, loss scale, data cursor, every rank's RNG, config) is extras.pt inside, written by
  rank 0 as a weights-only torch file: what the single-file format holds apart from model and optimizer.
- Atomic: the ranks write into checkpoints/.step-<N>.<host>.<pid>.tmp/ (rank 0's writer tag: the cleanup of a
  dead writer's leftovers removes it), and rank 0 renames it to step-<N>/ after DCP's metadata, the last file
  DCP writes once every rank's part is on disk, and extras.pt are there. A directory without both is never
  taken for a checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_amp.files import atomic_write, checksum_record, file_checksum, writer_tag

EXTRAS_FILE = "extras.pt"
DCP_METADATA_FILE = ".metadata"
CHECKSUMS_FILE = "checksums.json"
"""Inside step-<N>/: every other file's checksum record (files.checksum_record), by its name, written last before
the rename (a checkpoint written before checksums has none, and is read without)."""


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir()


def is_complete(path: Path) -> bool:
    return (path / DCP_METADATA_FILE).is_file() and (path / EXTRAS_FILE).is_file()


def unreadable_because(path: Path) -> str | None:
    """Why a complete-looking sharded checkpoint could not be read, checked cheaply before it is chosen; None when
    it can: DCP's metadata readable, and every part it names present and as long as the metadata says (a part
    lost, truncated or cut short by a copy). The tensors themselves are not read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or foreign pickle: torch raises several types
        return f"its {DCP_METADATA_FILE} is unreadable ({type(exc).__name__}: {str(exc).strip()[:120]})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"its part {name} is missing"
        if size < end:
            return f"its part {name} is cut short ({size} of {end} bytes)"
    return None


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer's own optimizer over this rank's parameters; any other optimizer itself."""
    return getattr(optimizer, "optim", optimizer)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def local_state(models: dict[str, nn.Module], optimizers: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
                with_optimizers: set[str] | None = None) -> dict[str, Any]:
    """This rank's part of each named model and optimizer (`optimizers`: name -> (the model it trains, itself)),
    as views of the live tensors (not copies): {name: state}.

    An optimizer's part only where it holds state (`with_optimizers` None, a save) or where named (a load's
    template): DCP's getter gives an empty optimizer state by running a zero-lr step on it, which would change
    a live run (Adam's step count) if a save came before the first step (a stop at step 0, or fp16 steps all
    skipped so far). An optimizer without state (SGD without momentum, or before any step) is saved without its
    part; its learning rate is the schedule's (formats.ShardedDirectory.load_weights)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    views = {name: get_model_state_dict(module, options=_options()) for name, module in models.items()}
    for name, (module, optimizer) in optimizers.items():
        local = _local_optimizer(optimizer)
        wanted = bool(local.state) if with_optimizers is None else name in with_optimizers
        views[name] = get_optimizer_state_dict(module, local, options=_options()) \
            if wanted and _owns_any(local) else {}
    return views


def _bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def own_bytes(state: dict[str, Any], replicated: tuple[str, ...]) -> int:
    """The bytes of this rank's own tensors, those not in the `replicated` parts (Strategy.replicated_parts,
    what every rank holds whole): ZeRO's optimizer state, FSDP's shards."""
    return sum(_bytes(getattr(value, "_local_tensor", value)) for part, values in state.items()
               if part not in replicated for value in values.values())


def own_share(state: dict[str, Any], replicated: tuple[str, ...], rank: int, own: list[int]) -> dict[str, Any]:
    """`state` less the replicated tensors another rank writes: each replicated tensor goes to one rank (the
    largest first, each to the rank with the fewest bytes so far, counting each rank's `own` bytes; every rank
    computes the same split from the same names and sizes), so that a rank stages, copies and writes only its
    share. The non-tensor values stay on every rank (DCP writes one of the identical copies)."""
    parts = replicated
    tensors = sorted(((part, name, _bytes(value)) for part in parts for name, value in state[part].items()
                      if isinstance(value, torch.Tensor) and not hasattr(value, "to_local")),
                     key=lambda item: (-item[2], item[0], item[1]))
    loads, owner = list(own), {}
    for part, name, size in tensors:
        chosen = loads.index(min(loads))
        loads[chosen] += size
        owner[part, name] = chosen
    return {part: {name: value for name, value in values.items() if owner.get((part, name), rank) == rank}
            if part in parts else values for part, values in state.items()}


def _owns_any(optimizer: torch.optim.Optimizer) -> bool:
    """ZeRO gives whole tensors to ranks: with more ranks than large tensors, a rank may own none at all."""
    return any(group["params"] for group in optimizer.param_groups)


def load_local_state(path: Path, models: dict[str, nn.Module],
                     optimizers: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
                     process_group: dist.ProcessGroup | None = None) -> None:
    """Every rank, collectively: the named models and optimizers (local_state's names) from a sharded
    checkpoint of any world size. The template (this rank's own state, an optimizer's initialised by DCP with a
    zero-lr step when it is still empty) says what to read; DCP reads into it, and it is loaded into the models
    and the optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    held = {name for name in optimizers if any(key.startswith(f"{name}.") for key in saved)}
    state = local_state(models, optimizers, with_optimizers=held)
    dcp.load(state, storage_reader=reader, process_group=process_group)
    for name, module in models.items():
        set_model_state_dict(module, state[name], options=_options())
    for name, (module, optimizer) in optimizers.items():
        if state[name]:
            set_optimizer_state_dict(module, _local_optimizer(optimizer), state[name], options=_options())


def nonfinite(state: Any) -> bool:
    """inf or NaN in this rank's part (its local shards) of a staged state."""
    if hasattr(state, "to_local"):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.is_floating_point() and not bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return any(nonfinite(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(nonfinite(value) for value in state)
    return False


def write(directory: Path, step: int, writer_tag: str, staged: dict[str, Any], extras: dict[str, Any] | None,
          process_group: dist.ProcessGroup) -> Path | None:
    """Every rank, collectively: write step-<step>/ under `directory`. `extras` on rank 0 only (None on the
    others, which return None); rank 0 renames the finished directory into place and returns its path."""
    import torch.distributed.checkpoint as dcp

    partial = directory / f".step-{step}.{writer_tag}.tmp"
    dcp.save(staged, storage_writer=dcp.FileSystemWriter(str(partial)), process_group=process_group)
    if extras is None:
        return None
    # DCP's coordinator (rank 0 of the group) returns once every rank's files and the metadata are written.
    buffer = io.BytesIO()
    torch.save(extras, buffer)
    atomic_write(partial / EXTRAS_FILE, buffer.getbuffer())
    write_checksums(partial, {EXTRAS_FILE: checksum_record(buffer.getbuffer())})
    final = directory / f"step-{step}"
    _replace_directory(partial, final)
    return final


def write_checksums(path: Path, known: dict[str, dict[str, Any]]) -> None:
    """The manifest of the directory's files (their checksums; `known`: those computed already, from the bytes
    before they were written): every rank's parts and DCP's metadata are read back (on the background writer,
    off the training thread; mostly from the page cache, just written)."""
    records = {name: known.get(name) or file_checksum(path / name) for name in sorted(os.listdir(path))
               if name != CHECKSUMS_FILE and (path / name).is_file()}
    atomic_write(path / CHECKSUMS_FILE, json.dumps(records, indent=1, sort_keys=True).encode())


def read_checksums(path: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest written with a sharded checkpoint: {} without one (written before checksums: read without),
    None where it is there and cannot be read (damaged itself)."""
    try:
        records = json.loads((path / CHECKSUMS_FILE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return records if isinstance(records, dict) and all(isinstance(r, dict) for r in records.values()) else None


def _replace_directory(source: Path, target: Path) -> None:
    """rename(2) source over target. A directory cannot replace a non-empty one: an older step-<N>/ (another
    launch's, at the same step) is moved aside first, then removed."""
    _fsync_directory(source)
    if target.exists():
        aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old.{writer_tag()}.", suffix=".tmp"))
        os.replace(target, aside / target.name)
        os.replace(source, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(source, target)
    _fsync_directory(target.parent)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_extras(path: Path) -> Any:
    """extras.pt of a sharded checkpoint, weights-only (tensors and plain types, never a pickled object)."""
    return torch.load(path / EXTRAS_FILE, map_location="cpu", weights_only=True)


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's state_dict from a sharded checkpoint, in this process alone (export, --init-from):
    DCP's own conversion to one torch.save file, read back weights-only."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="ddp-amp-dcp-") as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        state = torch.load(whole, map_location="cpu", weights_only=True)
    return state["model"]


def remove(path: Path) -> None:
    """Renamed away first (one atomic step: never a step-<N>/ half removed), then deleted; a kill in between
    leaves a dead writer's .tmp directory, which the next launch's cleanup removes."""
    doomed = path.with_name(f".{path.name}.{writer_tag()}.old.tmp")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
