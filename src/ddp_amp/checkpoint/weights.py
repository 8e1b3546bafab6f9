"""Model weights in and out of the formats users hold them in: --init-from and `ddp-amp export`.

Read: a state_dict file (.pt/.bin, ddp-amp's model.pt among them), a .safetensors file, a directory written by
`save_pretrained` (model.safetensors or pytorch_model.bin, sharded or not), or a ddp-amp checkpoint (its model;
a sharded one's gathered by DCP in this process). Every file is read with weights_only=True (tensors and plain
data; nothing unpickled runs). Wrapper prefixes torch itself adds (`module.` from DDP/DataParallel,
`_orig_mod.` from torch.compile) are removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddp_amp import files
from ddp_amp.checkpoint import sharded, storage

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
PRETRAINED_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class WeightsError(Exception):
    """The file is not weights ddp-amp can read, or they do not fit the model: one line, naming it."""


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise WeightsError(f"{path}: reading .safetensors needs the safetensors package (pip install "
                               "safetensors)") from None
        try:
            return load_file(str(path))
        except Exception as exc:  # a damaged download, a copy cut short: safetensors' own error, one line
            raise WeightsError(f"{path}: not a .safetensors file safetensors can read ({_first_line(exc)})") \
                from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if why := files.not_a_torch_file(path):
            raise WeightsError(f"{path}: {why}") from None
        raise WeightsError(f"{path}: not a state_dict torch can read safely ({type(exc).__name__})") from None
    if isinstance(state, dict) and {"trainer", "step", "config"} <= state.keys():  # a ddp-amp checkpoint
        state = state["trainer"].get("model")  # none in a sharded checkpoint's extras.pt: its parts hold it
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path}: holds no state_dict (a mapping of names to tensors)")
    return state


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict at `path`, in any of the module docstring's forms, wrapper prefixes removed."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or directory")
    if why := storage.part_of_a_checkpoint(path):
        raise WeightsError(f"{path}: {why}")
    # The bytes against the checksum written with them (a checkpoint's, in its sidecar or manifest; model.pt's
    # beside it), before anything is read: a damaged file loads as well as a whole one.
    if damage := storage.damage_of(path) or files.damage_of(path):
        raise WeightsError(damage)
    if path.is_dir():
        state: dict[str, torch.Tensor] = {}
        if sharded.is_complete(path):  # a sharded ddp-amp checkpoint (a DCP directory)
            if why := sharded.unreadable_because(path):
                raise WeightsError(f"{path}: a sharded checkpoint that cannot be read: {why}")
            try:
                state = sharded.read_model(path)
            except Exception as exc:  # what the cheap check above cannot see: corrupt bytes inside a part
                raise WeightsError(f"{path}: a sharded checkpoint that cannot be read ({type(exc).__name__}: "
                                   f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''})") \
                    from None
        elif (path / sharded.EXTRAS_FILE).is_file() or any(path.glob("*.distcp")):  # a write cut short, a copy
            raise WeightsError(f"{path}: a sharded checkpoint that cannot be read: incomplete (no "
                               f"{sharded.DCP_METADATA_FILE} or {sharded.EXTRAS_FILE})")
        elif index := next((path / name for name in INDEX_FILES if (path / name).is_file()), None):
            for shard in _shards_of(index):
                state.update(_load_file(path / shard))
        elif found := next((path / name for name in PRETRAINED_FILES if (path / name).is_file()), None):
            state = _load_file(found)
        elif (path / storage.CHECKPOINT_DIR).is_dir() or path.name == storage.CHECKPOINT_DIR:
            run = path if path.name != storage.CHECKPOINT_DIR else path.parent
            raise WeightsError(f"{path}: a run's " + ("directory" if run == path else "directory of checkpoints") +
                               f", not weights; give {run / 'model.pt'} or one of its checkpoints "
                               f"({storage.CHECKPOINT_DIR}/step-N.pt or step-N/)")
        else:
            raise WeightsError(f"{path}: a directory without {' or '.join(PRETRAINED_FILES)} (not written by "
                               "save_pretrained)")
    else:
        state = _load_file(path)
    return {_unwrapped(name): tensor for name, tensor in state.items()}


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__


def _shards_of(index: Path) -> list[str]:
    """The files a save_pretrained index (`*.index.json`) names, each there: else one line saying what is wrong."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise WeightsError(f"{index.parent}: {index.name} is not JSON (an object with a weight_map)") from None
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index.parent}: {index.name} has no weight_map (tensor name -> file)")
    shards = sorted(set(map(str, weight_map.values())))
    if missing := [shard for shard in shards if not (index.parent / shard).is_file()]:
        raise WeightsError(f"{index.parent}: {index.name} names {_first(missing)}, "
                           f"{'which is' if len(missing) == 1 else 'which are'} not there")
    return shards


def _unwrapped(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


@dataclass
class Fit:
    """How a state_dict fits a model."""

    loadable: dict[str, torch.Tensor] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    """'name: file (a, b) vs model (c, d)'."""

    def problems(self, strict: bool) -> list[str]:
        found = [f"shapes differ for {_first(self.mismatched)}"] if self.mismatched else []
        if strict and self.missing:
            found.append(f"{len(self.missing)} of the model's tensors are not in the file ({_first(self.missing)})")
        if strict and self.unexpected:
            found.append(f"{len(self.unexpected)} tensors of the file are not in the model "
                         f"({_first(self.unexpected)})")
        return found

    def counts(self) -> dict[str, int]:
        return {"loaded": len(self.loadable), "missing": len(self.missing), "unexpected": len(self.unexpected)}


def _first(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def fit(state: dict[str, torch.Tensor], model_state: dict[str, Any]) -> Fit:
    """`state` against a model's state_dict (tensors, or meta tensors: only names and shapes are read)."""
    result = Fit()
    for name, tensor in state.items():
        if name not in model_state:
            result.unexpected.append(name)
        elif tuple(tensor.shape) != tuple(model_state[name].shape):
            result.mismatched.append(f"{name}: file {tuple(tensor.shape)} vs model {tuple(model_state[name].shape)}")
        else:
            result.loadable[name] = tensor
    result.missing = [name for name in model_state if name not in state]
    return result


def load_into(model: torch.nn.Module, path: str | Path, *, strict: bool) -> dict[str, int]:
    """--init-from on a rank: the file's tensors copied into `model` (strict: all of them, all of it); the
    counts of what was loaded, missing and unexpected."""
    result = fit(read_weights(path), model.state_dict())
    if problems := result.problems(strict):
        raise WeightsError(f"--init-from {path}: " + "; ".join(problems))
    model.load_state_dict(result.loadable, strict=False)
    return result.counts()


def save_weights_file(state: dict[str, torch.Tensor], path: Path) -> None:
    """A state_dict as .safetensors (by its suffix) or a torch file, written atomically."""
    from ddp_amp.files import atomic_write

    state = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import save
        except ImportError:
            raise WeightsError(f"{path}: writing .safetensors needs the safetensors package") from None
        # safetensors refuses tensors that share memory (tied weights): store each once, as its own copy.
        data = save({name: tensor.clone() for name, tensor in state.items()})
        atomic_write(path, data)
        files.write_checksum(path, files.checksum_record(data))
        return
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write(path, buffer.getvalue())
    files.write_checksum(path, files.checksum_record(buffer.getbuffer()))


def pretrained_of(model: Any) -> Any:
    """What `save_pretrained` writes for a model: the model itself where it has that method (a Hugging Face
    model), or its `pretrained` attribute where that has it (a task's wrapper around one); else None."""
    for candidate in (model, getattr(model, "pretrained", None)):
        if candidate is not None and callable(getattr(candidate, "save_pretrained", None)):
            return candidate
    return None


def save_pretrained(model: Any, directory: Path) -> Path | None:
    """The model in its own format (`save_pretrained`), written beside it and renamed into place, so a kill
    leaves no half-written directory; None for a model without one."""
    import shutil
    import tempfile

    target = pretrained_of(model)
    if target is None:
        return None
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        target.save_pretrained(str(staging))
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
