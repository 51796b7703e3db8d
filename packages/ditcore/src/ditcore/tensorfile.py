"""Reading a safetensors file that may be truncated, edited or from a run that diverged.

The header (names, dtypes, shapes) is read alone first, so weights that do not fit a model are refused before
anything is allocated; a truncated or damaged file is one line, not safetensors' traceback; NaN/Inf weights are
named, since sampling them gives an all-black picture.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ditcore import durable


class DamagedFile(ValueError):
    """A tensor file that cannot be read as written: truncated, overwritten, or not safetensors at all."""


def _damaged(path: Path, error: Exception, what_to_do: str) -> DamagedFile:
    return DamagedFile(f"'{path}' is truncated or damaged ({str(error).splitlines()[0]}) — {what_to_do}")


def header(path: str | Path, what_to_do: str) -> dict[str, torch.Tensor]:
    """Name → a meta-device tensor of the stored dtype and shape: the header only, no data read or allocated."""
    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:  # checks that the data the header promises is all in the file
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
            return {name: torch.empty(s.get_shape(), dtype=_DTYPES[s.get_dtype()], device="meta")
                    for name, s in slices.items()}
    except (SafetensorError, KeyError, OSError) as e:
        if isinstance(e, OSError) and not path.is_file():
            raise
        raise _damaged(path, e, what_to_do) from None


def load(path: str | Path, what_to_do: str) -> dict[str, torch.Tensor]:
    """All tensors of a file (safetensors' load_file); DamagedFile when it cannot be read."""
    path = Path(path)
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise _damaged(path, e, what_to_do) from None


def save(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """safetensors' save_file, the file then given the mode the umask says (durable.mode_as_umask), like every
    other file ditcore writes."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    durable.mode_as_umask(path)


def non_finite(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that hold a NaN or an infinity (floating-point ones; integers are always finite)."""
    return [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]


# safetensors' dtype names (get_dtype) → torch dtypes
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}

__all__ = ["DamagedFile", "header", "load", "non_finite", "save"]
