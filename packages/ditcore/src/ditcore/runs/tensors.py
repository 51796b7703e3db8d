"""The tensors and plain values of a checkpoint, written and read with torch.distributed.checkpoint (DCP).

Keys are the one-device names: `model.blocks.0.attn.qkv.weight`, `ema.…`, `optim.<parameter>.exp_avg`; each rank
gives DCP its pieces of them as DTensors of their one-device shapes (ditcore.parallel.dist_checkpoint makes those
views of a model of any layout), writes the pieces it holds and reads the ones its layout needs, so a checkpoint
written with one layout resumes with any other, and `read_full` gives the one-device tensors without any process
group (what dit-sample loads). Plain values (step, loss history, learning-rate schedule, optimizer
hyper-parameters) are JSON, stored under `values` as a uint8 tensor of its UTF-8 bytes.

Nothing read from a checkpoint can run code: DCP reads tensors with torch's weights-only unpickler, its index
(`.metadata`, which DCP pickles) is read by `SafeReader` admitting only DCP's metadata types, and `SafeLoadPlanner`
reads byte entries (checkpoints from before JSON values pickled them; DCP itself would torch.load them with
weights_only=False) with the weights-only unpickler, then the restricted one (ditcore.safe_state). Every reader
here goes through both.
"""

from __future__ import annotations

import functools
import pathlib
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ditcore.safe_state import UnsafeFileError, from_json, restricted_loads, to_json, weights_only_load

MODEL, EMA, OPTIM = "model", "ema", "optim"
METADATA = ".metadata"  # DCP's index of every piece; written last by rank 0
VALUES = "values"  # the plain values: UTF-8 JSON as a uint8 tensor
MAX_VALUES_BYTES = 1 << 30  # far above any run's values (the loss history is ~30 bytes a step); bounds an allocation


def checkpoint_tensors(model: dict[str, torch.Tensor], ema: dict[str, torch.Tensor] | None = None,
                       optim: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's, EMA's and optimizer's tensors (by parameter name; the optimizer's as `<parameter>.<state>`)
    under the checkpoint's keys."""
    parts = {MODEL: model, EMA: ema or {}, OPTIM: optim or {}}
    return {f"{prefix}.{name}": t for prefix, part in parts.items() for name, t in part.items()}


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def load_optimizer_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                         f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(values)


def save_tensors(ckpt: Path, tensors: dict[str, torch.Tensor], values: dict) -> None:
    """Collective: every rank writes its pieces into `ckpt` (one file per rank, fsynced); rank 0 the index.

    `values` (the same on every rank) are written as one JSON document (a plain tensor: DCP stores it once).
    """
    writer = dcp.FileSystemWriter(str(ckpt), single_file_per_rank=True, sync_files=True)
    blob = torch.frombuffer(bytearray(to_json(values)), dtype=torch.uint8)
    dcp.save({**tensors, VALUES: blob}, storage_writer=writer)


def load_tensors(ckpt: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Collective: fill `tensors` in place from `ckpt`, whatever layout wrote it; returns the plain values."""
    reader = SafeReader(ckpt)
    state = {**tensors, VALUES: _values_slot(reader)}
    _dcp_load(state, reader)
    return _values(state[VALUES], ckpt)


def files_of_rank(ckpt: Path, rank: int) -> list[str]:
    """The files of a checkpoint folder that DCP's writer on `rank` wrote (rank 0 also writes the index)."""
    names = sorted(p.name for p in Path(ckpt).glob(f"__{rank}_*.distcp"))
    return names + ([METADATA] if rank == 0 and (Path(ckpt) / METADATA).is_file() else [])


def stored_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint holds, by key, with its one-device shape (from DCP's index; no tensor is read)."""
    meta = SafeReader(ckpt).read_metadata().state_dict_metadata
    return {k: tuple(m.size) for k, m in meta.items() if hasattr(m, "size")}


def model_mismatch(stored: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> str | None:
    """How the model and EMA tensors a checkpoint holds (`stored`) differ from those a model wants (`wanted`, the
    same keys and one-device shapes), in words; None if they are the same. DCP alone would load the keys the model
    asks for and drop the others, so a smaller model would load "fine"."""
    prefixes = tuple(f"{p}." for p in (MODEL, EMA))
    stored = {k: v for k, v in stored.items() if k.startswith(prefixes)}
    wanted = {k: v for k, v in wanted.items() if k.startswith(prefixes)}
    if stored == wanted:
        return None
    blocks = [len({k.split(".")[2] for k in keys if k.startswith(f"{MODEL}.blocks.")}) for keys in (stored, wanted)]
    if blocks[0] != blocks[1]:
        return f"the checkpoint's model has {blocks[0]} blocks, this one {blocks[1]} (model.depth, model.preset)"
    extra, missing = sorted(stored.keys() - wanted.keys()), sorted(wanted.keys() - stored.keys())
    shapes = sorted(k for k in stored.keys() & wanted.keys() if stored[k] != wanted[k])
    parts = []
    if extra:
        parts.append(f"the checkpoint has {len(extra)} tensors this model lacks (e.g. {extra[0]})")
    if missing:
        parts.append(f"this model has {len(missing)} tensors the checkpoint lacks (e.g. {missing[0]})")
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} tensors differ in shape (e.g. {k}: checkpoint {list(stored[k])}, this model "
                     f"{list(wanted[k])})")
    return "; ".join(parts)


def checkpoint_error(e: BaseException) -> str:
    """DCP's CheckpointException (a BaseException, with every rank's error and traceback in its text) as one line:
    the first rank's error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def read_full(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The one-device tensors under `prefix` (e.g. "ema"), on the CPU, without process groups: `{name: tensor}`."""
    reader = SafeReader(ckpt)
    meta = reader.read_metadata().state_dict_metadata
    start = prefix + "."
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(start) and hasattr(m, "size")}
    if not state:
        raise KeyError(f"the checkpoint holds no '{prefix}' tensors")
    _load_here(state, reader)
    return {k[len(start):]: v for k, v in state.items()}


def read_values(ckpt: Path) -> dict:
    """The plain values of a checkpoint (step, loss history, …), without process groups."""
    reader = SafeReader(ckpt)
    state = {VALUES: _values_slot(reader)}
    _load_here(state, reader)
    return _values(state[VALUES], ckpt)


def _load_here(state: dict, reader: SafeReader) -> None:
    """dcp.load in this process alone, whatever process group exists."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(state, reader, no_dist=True)


def _dcp_load(state: dict, reader: SafeReader, **kwargs) -> None:
    """dcp.load through the safe reader and planner. A refused entry comes out as the UnsafeFileError it is: DCP
    wraps what a rank raised while reading in a CheckpointException, a BaseException that `except Exception` misses."""
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        refused = next((f for f in failures if isinstance(f, UnsafeFileError)), None)
        if refused is None:
            raise
        raise UnsafeFileError(f"checkpoint {reader.path}: {refused}") from None


_FIX = "this is not what dit-train writes: resume from another checkpoint, or restore this one from a copy"


@functools.cache
def _metadata_admitted() -> dict[tuple[str, str], object]:
    """What DCP's index of a checkpoint is built from: its metadata dataclasses, torch.Size, dtypes and layouts (as
    torch pickles them), and the path DCP records of the folder it wrote. Each of these only builds a value."""
    admitted = {("torch.distributed.checkpoint.metadata", c.__name__): c for c in (
        dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata._MEM_FORMAT_ENCODING,
        dcp_metadata.StorageMeta, dcp_metadata.MetadataIndex)}
    admitted[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    admitted[("torch", "Size")] = torch.Size
    admitted |= {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    admitted[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("PosixPath", "PurePosixPath", "PureWindowsPath"):
        admitted[("pathlib", name)] = getattr(pathlib, name)
    admitted[("pathlib", "WindowsPath")] = pathlib.PureWindowsPath  # a checkpoint written on Windows
    return admitted


class SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader with its index read by a restricted unpickler (DCP's own calls pickle.load), once.

    The index must also keep every piece inside the checkpoint folder: it names the file each piece is in.
    """

    def __init__(self, ckpt: str | Path):
        super().__init__(str(ckpt))
        self._metadata = None

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self._metadata is None:
            self._metadata = self._read_index(Path(self.path) / METADATA)
        return self._metadata

    def _read_index(self, path: Path) -> dcp_metadata.Metadata:
        metadata = restricted_loads(path.read_bytes(), _metadata_admitted(), what=f"checkpoint index {path}",
                                    fix=_FIX)
        if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
            raise UnsafeFileError(f"checkpoint index {path} holds a {type(metadata).__name__}, not DCP metadata — "
                                  f"{_FIX}")
        for info in metadata.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise UnsafeFileError(f"checkpoint index {path} points outside its folder ({name!r}) — {_FIX}")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner, except that a byte entry is read with torch's weights-only unpickler (DCP's own uses
    weights_only=False). Our state dicts are flat: an entry's key is its place in the caller's dict."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        if fqn != VALUES:  # an index that calls a tensor bytes would leave the live tensor unloaded, silently
            raise UnsafeFileError(f"checkpoint entry {fqn!r} is stored as bytes; only {VALUES!r} ever was — {_FIX}")
        self.original_state_dict[fqn] = weights_only_load(value.getvalue(), what=f"checkpoint entry {fqn!r}", fix=_FIX)


def _values_slot(reader: SafeReader):
    """What `values` loads into: a uint8 tensor of the stored size, or b"" for a checkpoint that pickled them."""
    meta = reader.read_metadata().state_dict_metadata.get(VALUES)
    if isinstance(meta, dcp_metadata.TensorStorageMetadata):
        size = tuple(meta.size)
        if len(size) != 1 or not 0 < size[0] <= MAX_VALUES_BYTES or meta.properties.dtype != torch.uint8:
            raise UnsafeFileError(f"checkpoint {reader.path}: its {VALUES} entry is a {meta.properties.dtype} tensor "
                                  f"of shape {list(size)}, not JSON bytes — {_FIX}")
        return torch.empty(size, dtype=torch.uint8)
    return b""


def _values(entry, ckpt: Path) -> dict:
    what = f"checkpoint {ckpt}: its {VALUES} entry"
    if isinstance(entry, torch.Tensor):
        values = from_json(entry.numpy().tobytes(), what=what)
    elif isinstance(entry, bytes):  # from before JSON values: a pickle of plain values, read admitting no class
        values = restricted_loads(entry, what=what, fix=_FIX)
    else:
        raise UnsafeFileError(f"{what} is a {type(entry).__name__} — {_FIX}")
    if not isinstance(values, dict):
        raise UnsafeFileError(f"{what} is a {type(values).__name__}, not a dict — {_FIX}")
    return values
