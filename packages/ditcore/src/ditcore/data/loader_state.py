"""The data loader's position as it goes into a checkpoint: JSON, never a pickle (ditcore.safe_state).

Energon's `save_state_rank()` is a tree of its own state dataclasses around plain values, bytes (its workers' RNG
states), tensors and numpy arrays (the global RNG states of loader workers); those dataclasses are the only classes
admitted. Checkpoints from before JSON hold the same tree pickled (`loader-dpXXXXX.pkl`): they are read with a
restricted unpickler that admits those classes and what a pickled tensor or array needs, nothing else.
"""

from __future__ import annotations

import collections
import functools

import torch

from ditcore.safe_state import from_json, restricted_loads, to_json, weights_only_load


@functools.cache
def _energon_classes() -> dict[str, type]:
    """Energon's loader-state classes, by name (imported on first use: dit-sample never needs Energon)."""
    from megatron.energon.flavors.webdataset.sample_loader import SliceState
    from megatron.energon.rng import SystemRngState
    from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState
    from megatron.energon.state import FlexState

    classes = (SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState, SystemRngState, SliceState,
               FlexState)
    return {f"{c.__module__}.{c.__qualname__}": c for c in classes}


def state_to_json(state) -> bytes:
    """A loader's `save_state_rank()` as JSON bytes."""
    return to_json(state, _energon_classes())


def state_from_json(data: bytes, what: str = "loader state"):
    """The loader state `state_to_json` wrote, for `restore_state_rank`."""
    return from_json(data, _energon_classes(), what)


def _tensor_from_bytes(data: bytes):
    """Stands in for torch.storage._load_from_bytes (which torch.loads with weights_only=False): a pickled tensor's
    storage, read by torch's weights-only unpickler."""
    return weights_only_load(data, what="a tensor in the loader state", fix=_FIX)


@functools.cache
def _legacy_admitted() -> dict[tuple[str, str], object]:
    import numpy as np

    admitted = {tuple(name.rsplit(".", 1)): cls for name, cls in _energon_classes().items()}
    admitted |= {
        ("collections", "OrderedDict"): collections.OrderedDict,  # a pickled tensor's (empty) backward hooks
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,  # torch's weights-only list has it
        ("torch.storage", "_load_from_bytes"): _tensor_from_bytes,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1 and 2 name it differently
        admitted[(module, "_reconstruct")] = _np_reconstruct
    return admitted


def _np_reconstruct(cls, shape, dtype):
    """numpy's pickled arrays start from `_reconstruct(ndarray, shape, dtype)`; only a plain ndarray is built."""
    import numpy as np

    if cls is not np.ndarray:
        raise TypeError(f"an array of class {cls!r}")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def state_from_pickle(data: bytes, what: str = "loader state"):
    """A loader state pickled by an older dit-train (`loader-dpXXXXX.pkl`), read without running code."""
    return restricted_loads(data, _legacy_admitted(), what=what, fix=_FIX)


_FIX = "the file is not what dit-train writes: remove this checkpoint, or resume from another"
