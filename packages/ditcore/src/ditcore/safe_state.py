"""Reading state from files without ever running code from them: tagged JSON, and one restricted unpickler.

A pickle can call any function it names, so unpickling a file that someone else could have written (a checkpoint
copied from a shared disk, a dataset downloaded) runs their code. ditcore therefore writes its own state as JSON
(`to_json` / `from_json`): numbers, strings, lists and objects, plus a few tagged kinds (tuples, bytes, tensors and
arrays as base64 of their raw bytes, and dataclasses from an explicit allow-list, rebuilt through their own
constructor). Nothing in a JSON document names a function.

Files from before, and DCP's own index (`.metadata`, which torch pickles), are read with `restricted_loads`: the
unpickler may use only the classes and functions the caller admits by name, each of which only builds a value;
any other name in the file refuses the whole file with `UnsafeFileError`. torch.save'd tensors go through
`weights_only_load` (torch's weights-only unpickler, its refusal turned into one line).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

TYPE = "__type__"  # the key that marks a tagged value; no plain dict of ours has it


class UnsafeFileError(ValueError):
    """A file holds something ditcore refuses to load (a pickle that names a function outside the allow-list, or a
    JSON value of an unknown kind). Says which file and what to do."""


def to_json(value, classes: Mapping[str, type] = {}) -> bytes:
    """`value` as UTF-8 JSON that `from_json` turns back into an equal value (types kept: tuples stay tuples).
    classes: name → dataclass (or dict subclass) that may appear in `value`; anything else is a TypeError here,
    when the state is written, not when it is read back."""
    names = {cls: name for name, cls in classes.items()}
    return json.dumps(_encode(value, names), separators=(",", ":")).encode()


def from_json(data: bytes, classes: Mapping[str, type] = {}, what: str = "state"):
    """The value `to_json` wrote. A tag it does not know (a class outside `classes`) is an UnsafeFileError."""
    try:
        return _decode(json.loads(data), classes, what)
    except (ValueError, TypeError, KeyError) as e:
        if isinstance(e, UnsafeFileError):
            raise
        raise UnsafeFileError(f"{what} is not valid ditcore JSON state ({type(e).__name__}: {e})") from None


def _encode(v, names: dict[type, str]):
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [_encode(x, names) for x in v]
    if type(v) is tuple:
        return {TYPE: "tuple", "items": [_encode(x, names) for x in v]}
    if type(v) is bytes:
        return {TYPE: "bytes", "base64": base64.b64encode(v).decode()}
    if type(v) is dict:
        if all(type(k) is str for k in v) and TYPE not in v:
            return {k: _encode(x, names) for k, x in v.items()}
        return {TYPE: "dict", "items": [[_encode(k, names), _encode(x, names)] for k, x in v.items()]}
    numbers = _encode_numbers(v)
    return numbers if numbers is not None else _encode_admitted(v, names)


def _encode_numbers(v) -> dict | None:
    """A tensor, or a numpy array or scalar of numbers; None for anything else."""
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        return {TYPE: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "base64": base64.b64encode(t.view(-1).view(torch.uint8).numpy().tobytes()).decode()}
    if isinstance(v, np.ndarray) and v.dtype.kind in "biuf":
        return {TYPE: "ndarray", "dtype": v.dtype.str, "shape": list(v.shape),
                "base64": base64.b64encode(np.ascontiguousarray(v).tobytes()).decode()}
    if isinstance(v, np.generic) and v.dtype.kind in "biuf":
        return {TYPE: "scalar", "dtype": v.dtype.str, "value": v.item()}
    return None


def _encode_admitted(v, names: dict[type, str]) -> dict:
    name = names.get(type(v))
    if name is not None and isinstance(v, dict):
        return {TYPE: name, "items": _encode(dict(v), names)}
    if name is not None and dataclasses.is_dataclass(v):
        return {TYPE: name, "fields": {f.name: _encode(getattr(v, f.name), names) for f in dataclasses.fields(v)}}
    raise TypeError(f"cannot write a {type(v).__module__}.{type(v).__qualname__} as JSON state: it is not one of the "
                    f"kinds ditcore admits ({', '.join(sorted(names.values())) or 'plain values only'})")


def _decode(v, classes: Mapping[str, type], what: str):
    if isinstance(v, list):
        return [_decode(x, classes, what) for x in v]
    if not isinstance(v, dict):
        return v
    kind = v.get(TYPE)
    if kind is None:
        return {k: _decode(x, classes, what) for k, x in v.items()}
    if kind == "tuple":
        return tuple(_decode(x, classes, what) for x in v["items"])
    if kind == "bytes":
        return base64.b64decode(v["base64"], validate=True)
    if kind == "dict":
        return {_hashable(_decode(k, classes, what)): _decode(x, classes, what) for k, x in v["items"]}
    if kind == "tensor":
        return _decode_tensor(v, what)
    if kind in ("ndarray", "scalar"):
        return _decode_numpy(v, kind, what)
    return _decode_admitted(v, kind, classes, what)


def _decode_tensor(v: dict, what: str) -> torch.Tensor:
    dtype = getattr(torch, v["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise UnsafeFileError(f"{what} holds a tensor of unknown dtype {v['dtype']!r}")
    raw = bytearray(base64.b64decode(v["base64"], validate=True))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(v["shape"]).clone()


def _decode_numpy(v: dict, kind: str, what: str):
    dtype = np.dtype(str(v["dtype"]))
    if dtype.kind not in "biuf":
        raise UnsafeFileError(f"{what} holds an array of dtype {v['dtype']!r}; only numbers are admitted")
    if kind == "scalar":
        return dtype.type(v["value"])
    return np.frombuffer(base64.b64decode(v["base64"], validate=True), dtype=dtype).reshape(v["shape"]).copy()


def _decode_admitted(v: dict, kind: str, classes: Mapping[str, type], what: str):
    cls = classes.get(kind)
    if cls is None:
        raise UnsafeFileError(f"{what} holds a value of kind {kind!r}, which ditcore does not load (admitted: "
                              f"{', '.join(sorted(classes)) or 'plain values only'})")
    if issubclass(cls, dict):
        return cls(_decode(v["items"], classes, what))
    fields = {f.name for f in dataclasses.fields(cls)}
    if set(v["fields"]) != fields:
        raise UnsafeFileError(f"{what}: a {kind} has fields {sorted(v['fields'])}, this version has {sorted(fields)}")
    return cls(**{k: _decode(x, classes, what) for k, x in v["fields"].items()})


def _hashable(key):
    if isinstance(key, (list, dict)):
        raise TypeError(f"a {type(key).__name__} cannot be a key")
    return key


class _RestrictedUnpickler(pickle.Unpickler):
    """The pickle module's documented way to restrict a pickle: every class or function the data names is looked
    up here, and only the admitted ones are handed out. Persistent ids are refused by the base class."""

    def __init__(self, file, admitted: Mapping[tuple[str, str], Any], what: str, fix: str):
        super().__init__(file)
        self.admitted, self.what, self.fix = admitted, what, fix

    def find_class(self, module: str, name: str):
        try:
            return self.admitted[(module, name)]
        except KeyError:
            raise UnsafeFileError(f"{self.what} names {module}.{name}, which ditcore never loads from a file (it "
                                  f"could run code) — {self.fix}") from None


def restricted_loads(data: bytes, admitted: Mapping[tuple[str, str], Any] = {}, *, what: str, fix: str):
    """Unpickle `data` admitting only the globals in `admitted` ((module, name) → the object to use; with none,
    only plain values: numbers, strings, bytes, lists, tuples, dicts, sets). what: the file, for errors."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data), admitted, what, fix).load()
    except UnsafeFileError:
        raise
    except Exception as e:  # truncated or garbled: the unpickler's errors vary (EOFError, UnpicklingError, …)
        raise UnsafeFileError(f"{what} does not unpickle ({type(e).__name__}: {e}) — {fix}") from None


def weights_only_load(data: bytes | Path, *, what: str, fix: str):
    """torch.load of bytes, or of a file, with torch's weights-only unpickler (tensors and plain values, nothing
    else). A file in torch's zip format is memory-mapped: its tensors' bytes are not read until used, so checking a
    large file costs its pickle alone. Its refusal is many lines that suggest weights_only=False; here it is one line
    naming what the file tried to load."""
    mmap = isinstance(data, Path) and zipfile.is_zipfile(data)
    try:
        with warnings.catch_warnings():  # a pickle of protocol > 2 is warned about before it is read or refused
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            source = data if isinstance(data, Path) else io.BytesIO(data)
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # UnpicklingError (refused), RuntimeError (not a torch file), EOFError (truncated), …
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # what was refused: a global it named (GLOBAL posix.system) or an opcode it does not run (Unsupported
        # operand 149: a protocol-4 pickle's STACK_GLOBAL), rather than torch's advice to load it unsafely
        reason = next((line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")),
                      lines[0] if lines else type(e).__name__)
        raise UnsafeFileError(f"{what} does not load as tensors ({reason}) — {fix}") from None
