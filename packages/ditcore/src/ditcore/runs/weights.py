"""A checkpoint's weights on one device, for sampling: verified against its manifest, then consolidated from the
pieces of whatever layout wrote them. Reads with no process group and imports nothing from ditcore.parallel."""

from __future__ import annotations

from pathlib import Path

import torch

from ditcore.runs.folders import MARKER, CheckpointError, is_complete
from ditcore.runs.manifest import read_manifest, verify
from ditcore.runs.tensors import EMA, METADATA, read_full


def load_weights(ckpt: str | Path, key: str = EMA) -> dict[str, torch.Tensor]:
    """A checkpoint's one-device weights (EMA by default), consolidated from the pieces of any layout, verified
    first."""
    ckpt = Path(ckpt)
    if not is_complete(ckpt):
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {MARKER} marker in a step-XXXXXXX folder)")
    manifest = read_manifest(ckpt)
    files = manifest.get("files") or {}
    if METADATA not in files:
        raise CheckpointError(f"checkpoint {ckpt} was written by an older dit-train (no {METADATA} "
                              "in its manifest): sample from that run's export/ instead")
    for name in files:
        problem = verify(ckpt, name, manifest) if (ckpt / name).is_file() else f"checkpoint {ckpt} has lost {name}"
        if problem:
            raise CheckpointError(problem)
    try:
        return read_full(ckpt, key)
    except Exception as e:  # verified, yet unreadable (another version, or no `key` in it)
        raise CheckpointError(f"checkpoint {ckpt} does not load: {type(e).__name__}: {e}") from None
