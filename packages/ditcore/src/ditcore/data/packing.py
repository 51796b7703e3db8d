"""Sequence packing: several samples' tokens in one row of `seq_length`, each keeping its own identity.

A packed batch holds what ditcore.models.DiT.forward takes (`PackedBatch.inputs`, a ditcore.inputs.Inputs): token
rows with `seg` naming each token's sample (−1 for padding), per-sample (B, S) conditions, and text tokens tagged the
same way. Which per-sample conditions a batch holds, and which key of a sample's JSON metadata each is read from, the
architecture's Inputs type declares (`Inputs.per_sample_fields`): packing names none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, patchify


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= capacity, longest items first.

    Every item that fits on its own is placed; an item longer than capacity raises (callers skip those first).
    """
    bins: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"item {i} has {lengths[i]} tokens, more than the row capacity {capacity}")
        for b, free in enumerate(space):
            if lengths[i] <= free:
                bins[b].append(i)
                space[b] -= lengths[i]
                break
        else:
            bins.append([i])
            space.append(capacity - lengths[i])
    return bins


@dataclass
class TokenSample:
    """One sample after patchify: what packing works with."""

    key: str
    tokens: torch.Tensor  # (n, patch_dim)
    pos: torch.Tensor  # (n, 3) long: (t, h, w) grid positions
    grid: tuple[int, int, int]  # (T', H', W') token grid, to unpatchify
    text: torch.Tensor  # (L, D) unpadded
    meta: dict  # the sample's JSON metadata (ditcore.data.schema): its per-sample conditions are read from it
    caption: str
    source: str = ""  # the dataset of a blend it came from (ditcore.data.blend); "" outside a blend
    cfg_drop: float | None = None  # its dataset's CFG dropout rate (a blend's cfg_drop subflavor); None: the run's

    @classmethod
    def of(cls, key: str, latent: torch.Tensor, text: torch.Tensor, meta: dict, patch_size: int, patch_size_t: int,
           source: str = "", cfg_drop: float | None = None) -> TokenSample:
        """A dataset sample (latent (C, T, H, W) divisible by the patch, text states, metadata), patchified."""
        _, T, H, W = latent.shape
        grid = (T // patch_size_t, H // patch_size, W // patch_size)
        return cls(key=key, tokens=patchify(latent[None].float(), patch_size, patch_size_t)[0],
                   pos=grid_positions(grid), grid=grid, text=text.float(), meta=dict(meta),
                   caption=str(meta.get("caption", "")), source=source, cfg_drop=cfg_drop)


@dataclass
class PackedRow:
    samples: list[TokenSample]

    @property
    def length(self) -> int:
        return sum(s.tokens.shape[0] for s in self.samples)


@dataclass
class PackedBatch:
    """B rows of N = seq_length tokens; S = the most samples any row holds."""

    x: torch.Tensor  # (B, N, patch_dim) float32; zeros on padding
    pos: torch.Tensor  # (B, N, 3) long
    seg: torch.Tensor  # (B, N) long: sample index within the row, −1 on padding
    text: torch.Tensor  # (B, L, D) float32
    text_seg: torch.Tensor  # (B, L) long
    # (B, S) per-sample conditions by Inputs field name (class_labels, fps, ...): each sample's value, the field's
    # `missing` value where a slot is unused or the sample has none (an unlabelled sample's class: −1)
    conditions: dict[str, torch.Tensor]
    num_samples: torch.Tensor  # (B,) samples in each row
    keys: list[list[str]]
    captions: list[list[str]]
    grids: list[list[tuple[int, int, int]]]
    skipped: dict = field(default_factory=dict)  # samples skipped (by reason) since this worker's last batch
    skipped_samples: list = field(default_factory=list)  # ... and which: (key, reason, detail), logged once each
    whole_rows: bool = False  # every row is one sample without padding (known on the host, so no device sync)
    whole_text: bool = False  # ... and every text token belongs to its row's sample
    inputs_class: type[Inputs] = Inputs  # the architecture's (ditcore.inputs): what `inputs` builds
    sources: list[list[str]] = field(default_factory=list)  # each sample's dataset of a blend ("" outside one)
    # (B, S) float32 CFG dropout rate of each sample whose dataset sets one (a blend's cfg_drop), NaN for the run's
    # edm.cfg_dropout; None when no sample's dataset sets one
    drop_rate: torch.Tensor | None = None

    TENSORS = ("x", "pos", "seg", "text", "text_seg", "num_samples")

    @property
    def mask(self) -> torch.Tensor:  # (B, N) real tokens
        return self.seg >= 0

    @property
    def class_labels(self) -> torch.Tensor:  # (B, S) long, −1 where a slot is unused or the sample has no label
        return self.conditions["class_labels"]

    @property
    def per_sample_shape(self) -> tuple[int, int]:
        """(B, S): rows, and the most samples a row holds, known on the host."""
        return len(self.grids), max(len(row) for row in self.grids)

    def inputs(self) -> Inputs:
        """What the model reads of these rows besides the tokens and noise level (on the batch's device). CFG dropout
        (ditcore.training.draw) and the null class of unlabelled samples are Inputs.dropped's. `grids` stays on the
        host: ST-DiT reads the rows' frames and time-lines from it, not from the device (ditcore.models.stdit)."""
        seg = None if self.whole_rows else self.seg  # nothing to mask: unmasked attention (flash on a GPU)
        text_seg = None if self.whole_rows and self.whole_text else self.text_seg
        return self.inputs_class(pos=self.pos, seg=seg, text=self.text, text_seg=text_seg, grids=self.grids,
                                 **self.conditions)

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        move = lambda t: t.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, conditions={k: move(t) for k, t in self.conditions.items()},
                                   drop_rate=None if self.drop_rate is None else move(self.drop_rate),
                                   **{k: move(getattr(self, k)) for k in self.TENSORS})

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies (torch's DataLoader calls this when it pins batches), so copies to a GPU are async."""
        return dataclasses.replace(self, conditions={k: t.pin_memory() for k, t in self.conditions.items()},
                                   drop_rate=None if self.drop_rate is None else self.drop_rate.pin_memory(),
                                   **{k: getattr(self, k).pin_memory() for k in self.TENSORS})

    def by_source(self) -> dict[str, tuple[int, int]]:
        """Samples and tokens of each dataset of a blend in these rows (host values): source → (samples, tokens)."""
        out: dict[str, tuple[int, int]] = {}
        for row_sources, row_grids in zip(self.sources, self.grids, strict=True):
            for source, (t, h, w) in zip(row_sources, row_grids, strict=True):
                n, k = out.get(source, (0, 0))
                out[source] = (n + 1, k + t * h * w)
        return out


def drop_rates(rows: list[PackedRow], slots: int) -> torch.Tensor | None:
    """(B, slots) float32: each sample's dataset's CFG dropout rate, NaN where it sets none (the run's) and in empty
    slots; None when no sample's dataset sets one."""
    rates = [[s.cfg_drop for s in row.samples] for row in rows]
    if all(r is None for row in rates for r in row):
        return None
    nan = float("nan")
    return torch.tensor([[nan if r is None else r for r in row] + [nan] * (slots - len(row)) for row in rates],
                        dtype=torch.float32)


def collate(rows: list[PackedRow], seq_length: int, text_multiple: int = 1,
            inputs: type[Inputs] = Inputs) -> PackedBatch:
    """Rows → one batch; the text length L is the longest row's text, padded up to a multiple of text_multiple.
    Every per-sample condition of `inputs` is read from each sample's metadata (PerSample.key)."""
    B = len(rows)
    first = rows[0].samples[0]
    patch_dim, text_dim = first.tokens.shape[1], first.text.shape[1]
    S = max(len(r.samples) for r in rows)
    L = max(sum(s.text.shape[0] for s in r.samples) for r in rows)
    L = -(-L // text_multiple) * text_multiple
    fields = inputs.per_sample_fields()
    out = PackedBatch(
        x=torch.zeros(B, seq_length, patch_dim), pos=torch.zeros(B, seq_length, 3, dtype=torch.long),
        seg=torch.full((B, seq_length), -1), text=torch.zeros(B, L, text_dim), text_seg=torch.full((B, L), -1),
        conditions={name: torch.full((B, S), spec.missing, dtype=spec.dtype) for name, spec in fields.items()},
        num_samples=torch.zeros(B, dtype=torch.long), keys=[], captions=[], grids=[], inputs_class=inputs,
    )
    for b, row in enumerate(rows):
        n = t = 0
        for s, smp in enumerate(row.samples):
            k, ln = smp.tokens.shape[0], smp.text.shape[0]
            out.x[b, n:n + k], out.pos[b, n:n + k], out.seg[b, n:n + k] = smp.tokens, smp.pos, s
            out.text[b, t:t + ln], out.text_seg[b, t:t + ln] = smp.text, s
            for name, spec in fields.items():
                out.conditions[name][b, s] = smp.meta.get(spec.key, spec.missing)
            n, t = n + k, t + ln
        out.num_samples[b] = len(row.samples)
        out.keys.append([s.key for s in row.samples])
        out.captions.append([s.caption for s in row.samples])
        out.grids.append([s.grid for s in row.samples])
        out.sources.append([s.source for s in row.samples])
    out.drop_rate = drop_rates(rows, S)
    out.whole_rows = S == 1 and all(row.length == seq_length for row in rows)
    out.whole_text = bool((out.text_seg >= 0).all())
    return out
