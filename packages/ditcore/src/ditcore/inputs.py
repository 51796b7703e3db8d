"""A model's inputs for one batch of token rows, as one typed object: `Inputs`, which the architecture declares.

The objective owns the noisy tokens and their noise level (it makes them from the data, again at every sampler
step); everything else a model reads is an `Inputs`: where each token sits (pos) and whose it is (seg), the text and
whose each text token is (text_seg), the rows' grids on the host, and the *per-sample conditions* (B, S): a class,
an fps, and whatever an architecture adds. Every producer builds one and the model takes it:

    the loader's batches       ditcore.data.packing.PackedBatch.inputs (per-sample values from each sample's metadata)
    CFG dropout                Inputs.dropped (ditcore.training.draw)
    the planner's probes       Inputs.planned (ditcore.memory, ditcore.traffic, ditcore.flops)
    the samplers               Inputs.for_sampling (ditcore.sampling)
    the model                  DiT.forward(x, c_noise, inputs); DiT.inputs_class names its architecture's type

A new conditioning input is one field of the architecture's own subclass, declared with `per_sample(...)` (the key of
a dataset sample's JSON metadata it is read from, its dtype, its value where a sample lacks it, whether CFG dropout
replaces it), set as its model class's `inputs_class`, and read in the model's `condition`: the loader, CFG
dropout, the probes and the samplers handle it from that declaration, and nothing else names it
(tests/ditcore/test_inputs.py adds one to an architecture registered from outside ditcore).

Inputs is a pytree (its subclasses too), so that FSDP's input casts and torch.compile see the tensors inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ditcore.layout import grid_rows

Grids = list[list[tuple[int, int, int]]]  # per row, its samples' (T, H, W) token grids in order (ditcore.layout)


@dataclass(frozen=True)
class PerSample:
    """How one per-sample condition (B, S) is read, filled, dropped and defaulted, for a model config `cfg`.

    key: its key in a dataset sample's JSON metadata (ditcore.data.schema), read by the loader.
    missing: the value of a sample without the key, and of a row's unused slots.
    used: whether the model of cfg reads it; the planner's probes and the samplers give it only then.
    null: CFG dropout's value (replacing dropped samples' values and missing ones), None: never dropped.
    default: the value sampling and the probes give when no value is asked for; None: the null value.
    """

    key: str
    dtype: torch.dtype
    missing: float | int
    used: Callable[[Any], bool]
    null: Callable[[Any], float | int] | None = None
    default: float | int | None = None

    def value(self, cfg) -> float | int:
        """What a sample is given when nothing is asked for (sampling, the probes)."""
        if self.default is None:
            return self.null(cfg)
        return self.default


def per_sample(key: str, dtype: torch.dtype, missing: float | int, used: Callable[[Any], bool], *,
               null: Callable[[Any], float | int] | None = None, default: float | int | None = None):
    """A field of an Inputs (sub)class holding a per-sample condition (B, S), None when the model does not read it."""
    if default is None and null is None:
        raise ValueError(f"per-sample input {key!r} needs a default or a null value for sampling and the probes")
    spec = PerSample(key, dtype, missing, used, null, default)
    return dataclasses.field(default=None, metadata={"per_sample": spec})


def _is_class_conditional(cfg) -> bool:
    return cfg.num_classes > 0


def _reads_fps(cfg) -> bool:
    return cfg.fps_cond


def _null_class(cfg) -> int:
    return cfg.num_classes  # the embedder's extra row (ditcore.models.dit)


@dataclass
class Inputs:
    """What a DiT reads of one batch of B token rows of N tokens besides the tokens and their noise level.

    pos: (B, N, 3) or (N, 3) integer (t, h, w) positions; seg: (B, N) each token's sample, -1 padding, or None (every
    row one sample); text: (B, L, text_dim) with text_seg (B, L) naming each text token's sample (-1 padding), None
    for a model without text; grids: the rows' layout on the host (ST-DiT regroups by it without reading the device).
    The per-sample conditions follow, each (B, S) or None when the model does not read it.
    """

    pos: torch.Tensor
    seg: torch.Tensor | None = None
    text: torch.Tensor | None = None
    text_seg: torch.Tensor | None = None
    grids: Grids | None = None
    # per_sample returns a dataclasses.field (a None default with its declaration as metadata), which RUF009 cannot see
    class_labels: torch.Tensor | None = per_sample(  # noqa: RUF009
        "label", torch.long, -1, _is_class_conditional, null=_null_class)
    fps: torch.Tensor | None = per_sample("fps", torch.float32, 0.0, _reads_fps, default=8.0)  # noqa: RUF009

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)  # a subclass is made a dataclass after this: register_dataclass reads its fields lazily

    @classmethod
    def per_sample_fields(cls) -> dict[str, PerSample]:
        """Field name → how it is read, filled and dropped: every per-sample condition this type holds."""
        return {f.name: f.metadata["per_sample"] for f in dataclasses.fields(cls) if "per_sample" in f.metadata}

    def replace(self, **changes) -> Inputs:
        return dataclasses.replace(self, **changes)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every tensor field that is set."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                yield f.name, value

    def conditions(self) -> Inputs:
        """The per-sample conditions alone (every other field None): what a block with its own embedders reads."""
        keep = self.per_sample_fields()
        return type(self)(**{f.name: getattr(self, f.name) if f.name in keep else None
                             for f in dataclasses.fields(self)})

    def to(self, device, non_blocking: bool = False) -> Inputs:
        return self.replace(**{k: t.to(device, non_blocking=non_blocking) for k, t in self.tensors()})

    def dropped(self, drop: torch.Tensor | None, cfg) -> Inputs:
        """CFG dropout of the samples where drop (B, S) is True (None: of none): their text becomes empty (every text
        token masked) and each condition with a null value takes it, as do missing values (an unlabelled sample's
        class is the null class). Conditions without a null value are kept."""
        changes, text_seg = {}, self.text_seg
        if text_seg is None and self.text is not None:  # rows of one sample each, every text token real
            text_seg = torch.zeros(self.text.shape[:2], dtype=torch.long, device=self.text.device)
        if drop is not None and text_seg is not None and text_seg.numel():
            dropped = drop.gather(1, text_seg.clamp(min=0)) & (text_seg >= 0)
            changes["text_seg"] = torch.where(dropped, -1, text_seg)
        for name, spec in self.per_sample_fields().items():
            value = getattr(self, name)
            if value is not None and spec.null is not None:
                nulled = value == spec.missing if drop is None else drop | (value == spec.missing)
                changes[name] = torch.where(nulled, spec.null(cfg), value)
        return self.replace(**changes)

    @classmethod
    def planned(cls, cfg, grids: Grids, N: int, L: int, packed: bool) -> Inputs:
        """Inputs of the planned shapes for rows of N tokens laid out as `grids` (make it under a model's fake mode
        for fake tensors): packed rows name each token's sample and share L text tokens among their samples in equal
        parts; unpacked ones (one sample each) carry no masks. Every condition the model reads has its default."""
        B, S = len(grids), max(len(row) for row in grids)
        seg, pos = grid_rows(grids, N)
        text_seg = (torch.arange(L) // max(1, -(-L // S))).expand(B, -1) if packed else None
        text = torch.empty(B, L, cfg.text_dim) if cfg.text_dim else None
        conditions = {name: torch.full((B, S), spec.value(cfg), dtype=spec.dtype)
                      for name, spec in cls.per_sample_fields().items() if spec.used(cfg)}
        return cls(pos=pos, seg=seg if packed else None, text=text, text_seg=text_seg, grids=grids, **conditions)

    @classmethod
    def for_sampling(cls, cfg, rows: int, pos: torch.Tensor, grid: tuple[int, int, int], text=None, text_seg=None,
                     values: dict | None = None, unconditional: int = 0) -> Inputs:
        """Inputs of `rows` sampled rows of one sample each, then `unconditional` more for classifier-free guidance
        (their conditions with a null value take it). values: a condition's name → one value for every row, or a
        list of one per row; a condition the model reads but that is not given has its default."""
        device, values = pos.device, values or {}
        conditions = {}
        for name, spec in cls.per_sample_fields().items():
            if not spec.used(cfg):
                continue
            given = values.get(name)
            given = spec.value(cfg) if given is None else given
            column = list(given) if isinstance(given, list | tuple) else [given] * rows
            if len(column) != rows:
                raise ValueError(f"{name}: {len(column)} values for {rows} samples")
            null = [spec.null(cfg)] * unconditional if spec.null is not None else column[:unconditional]
            conditions[name] = torch.tensor(column + null, dtype=spec.dtype, device=device)[:, None]
        n = rows + unconditional
        return cls(pos=pos, text=text, text_seg=text_seg, grids=[[grid]] * n, **conditions)


def _register(cls: type) -> None:
    def flatten(obj):
        names = [f.name for f in dataclasses.fields(obj)]
        return [getattr(obj, n) for n in names], (type(obj), names)

    def unflatten(children, context):
        kind, names = context
        return kind(**dict(zip(names, children, strict=True)))

    def flatten_with_keys(obj):
        children, context = flatten(obj)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(context[1], children, strict=True)], context

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)


_register(Inputs)
