"""Loading pretrained models (VAEs, text encoders) from a local folder or the Hugging Face hub.

Offline, `from_pretrained` on a hub id ends in a long chained traceback about HTTP retries and cache
misses; here it becomes one line that names the id and what to do instead. And it comes at once: huggingface_hub
retries each request five times, 25-45 s for every file a loader looks up (a minute and more for a text encoder's
tokenizer and model), so where the hub cannot be reached (`offline`: HF_HUB_OFFLINE, or no connection to its endpoint
within a few seconds) the loaders read the local cache alone (local_files_only), which fails or succeeds without a
request.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from ditcore.safe_state import weights_only_load

# the names diffusers and transformers give pickled weights (a .bin is read only where no safetensors file is)
PICKLED_WEIGHTS = ("diffusion_pytorch_model*.bin", "pytorch_model*.bin")


class HubLoadError(OSError):
    """A model named by hub id could not be fetched (no network, unknown id, gated repository)."""


def offline(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached, in words, or None where it can: HF_HUB_OFFLINE (huggingface_hub's own switch:
    1, true, yes or on), else a TCP connection to its endpoint (HF_ENDPOINT) that fails within `timeout` seconds
    (a name that does not resolve fails at once). Probed once per process."""
    from huggingface_hub import constants

    # constants: what huggingface_hub read at import (and the loaders obey); the variable: set since
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    return _unreachable(timeout)


@functools.cache
def _unreachable(timeout: float) -> str | None:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"the hub ({url.hostname}) is unreachable: {e.strerror or type(e).__name__}"
    return None


def offline_hint(source: str) -> str:
    """How to have a hub model without the network: a folder, or the cache filled beforehand; and the switch that
    keeps every later look-up from waiting for the network."""
    return (f"pass a local folder that holds its files instead (one written by save_pretrained, or `hf download "
            f"{source} --local-dir DIR` on a machine with network), or pre-download it into the Hugging Face cache "
            f"(`hf download {source}`, HF_HOME) and set HF_HUB_OFFLINE=1 so that no look-up waits for the network")


def looks_like_path(source: str) -> bool:
    """Hub ids are 'name' or 'owner/name'; anything else that names no existing folder is a mistyped path."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


def from_pretrained(cls, source: str | Path, what: str, **kwargs):
    """`cls.from_pretrained(source, **kwargs)`, where `source` is a local folder (never touches the network)
    or a hub id. `what` names the model in errors, e.g. "VAE"."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        check_pickled_weights(folder / (kwargs.get("subfolder") or ""), what)
        return cls.from_pretrained(str(folder), local_files_only=True, **kwargs)
    if looks_like_path(str(source)):
        raise FileNotFoundError(f"{what} folder {str(source)!r} does not exist — pass an existing folder or a hub id")
    why = offline()
    try:
        return cls.from_pretrained(str(source), **kwargs, **({"local_files_only": True} if why else {}))
    except OSError as err:  # transformers, diffusers and huggingface_hub report fetch failures as OSError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if why:  # nothing was asked of the network: the cache does not hold it
            raise HubLoadError(f"could not load {what} {str(source)!r} from the Hugging Face hub (offline: {why}; "
                               f"not in its local cache) — {offline_hint(str(source))}") from None
        raise HubLoadError(
            f"could not load {what} {str(source)!r} from the Hugging Face hub — {offline_hint(str(source))}. The "
            f"loader said: {reason}"
        ) from None


def check_pickled_weights(folder: Path, what: str) -> None:
    """Where a local folder holds its weights only as pickles (diffusers' and transformers' first saves), each is
    read first with torch's weights-only unpickler (memory-mapped: the tensors' bytes are left to the library's own
    load): a file that holds more than tensors is refused in one line naming it and what it tried to load, before the
    library's loader (and its page of log lines) sees it."""
    if any(folder.glob("*.safetensors")):
        return  # the libraries then read the safetensors file and never the pickle
    for path in sorted(p for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern)):
        weights_only_load(path, what=f"{what} weights '{path}'",
                          fix="ditcore loads no pickled Python objects: save the weights as safetensors "
                              "(save_pretrained(..., safe_serialization=True)) on a machine you trust")
