"""Loading pretrained models (VAEs, text encoders) from a local folder or the Hugging Face hub.

Offline, `from_pretrained` on a hub id ends in a long chained traceback about HTTP retries and cache
misses; here it becomes one line that names the id and what to do instead.
"""

from __future__ import annotations

from pathlib import Path

from ditcore.safe_state import weights_only_load

# the names diffusers and transformers give pickled weights (a .bin is read only where no safetensors file is)
PICKLED_WEIGHTS = ("diffusion_pytorch_model*.bin", "pytorch_model*.bin")


class HubLoadError(OSError):
    """A model named by hub id could not be fetched (no network, unknown id, gated repository)."""


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
    try:
        return cls.from_pretrained(str(source), **kwargs)
    except OSError as err:  # transformers, diffusers and huggingface_hub report fetch failures as OSError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HubLoadError(
            f"could not load {what} {str(source)!r} from the Hugging Face hub (offline?) — pass a local folder that "
            f"holds its files instead (e.g. one written by save_pretrained, or `hf download {source} --local-dir "
            f"DIR` on a machine with network). The loader said: {reason}"
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
