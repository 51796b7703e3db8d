"""Streaming a prepared dataset with Energon: cook → patchify → pack (first-fit-decreasing) → batch.

The loader is Energon's savable loader: `loader.save_state_rank()` goes into every checkpoint and
`restore_state_rank(state)` on a fresh loader, before iterating, continues with exactly the batches an
uninterrupted run would have seen (with any number of workers). Its WorkerConfig comes from the
data-parallel rank/size/group, so tensor- and context-parallel peers get identical batches.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import hashlib
import json
import logging
import math
import multiprocessing
import os
import signal
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from megatron.energon import (
    Cooker,
    CrudeSample,
    SavableDataLoader,
    SkipSample,
    TaskEncoder,
    WorkerConfig,
    basic_sample_keys,
    get_train_dataset,
    stateless,
)
from megatron.energon.errors import FatalSampleError
from megatron.energon.flavors.base_dataset import Sample
from megatron.energon.wrappers.blend_dataset import BlendDataset

from ditcore import quiet
from ditcore.data.blend import NAME_KEY, Member, metadataset, to_blend_units
from ditcore.data.blend import members as blend_members
from ditcore.data.fit import latent_shapes, tokens_of
from ditcore.data.packing import PackedBatch, PackedRow, TokenSample, collate, first_fit_decreasing
from ditcore.data.schema import INFO_FILE, DatasetError, crude_config, read_info, read_sample
from ditcore.inputs import Inputs

log = logging.getLogger(__name__)

# A normalised latent has a standard deviation of SIGMA_DATA per channel (dit-prepare divides by the channel's
# statistics): a value 10^4 times larger is a broken encoder or file, not data. Left in, it makes the loss
# overflow and the divergence would be blamed on the learning rate.
LATENT_BOUND = 1e4
MAX_SKIPPED_IN_A_ROW = 1000  # the default of data.max_skipped_in_a_row
# Skipped samples named in the log per reason, in the whole run and each once (SkipLog); the rest are only counted. A
# few examples say what is wrong; thousands of lines from a dataset with many bad samples would bury the progress.
LOGGED_PER_REASON = 10


class TooManySkipped(FatalSampleError):
    """No usable sample in the last `bound` samples read. A FatalSampleError, so that Energon's error handling
    passes it on; Energon and torch's loader workers re-raise it wrapped in their own words, so its facts travel
    as JSON between markers (`too_many_skipped` finds them)."""

    MARK = "[ditcore skipped in a row: "

    def __init__(self, counts: dict | str):
        super().__init__(counts if isinstance(counts, str) else f"{self.MARK}{json.dumps(counts)}]")


def too_many_skipped(e: BaseException) -> Counter | None:
    """The skip reasons a TooManySkipped raised somewhere in the loader carried, however it was wrapped; else None."""
    text = str(e)
    start = text.rfind(TooManySkipped.MARK)
    if start < 0:
        return None
    body = text[start + len(TooManySkipped.MARK):]
    return Counter(json.loads(body[:body.index("}") + 1]))


def dataset_files(root: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of the shards, their indexes and the files that describe them: what changes when
    the dataset is prepared again or a shard is replaced (not split-verified.yaml, which build_loader writes)."""
    files = [p for p in root.iterdir() if p.suffix in (".tar", ".idx")] + [
        root / INFO_FILE, root / ".nv-meta" / ".info.json", root / ".nv-meta" / "index.uuid"]
    stats = {}
    for p in files:
        with contextlib.suppress(OSError):
            st = p.stat()
            stats[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return stats


def changed_files(root: Path, before: dict[str, tuple[int, int]]) -> list[str]:
    """The files of `before` (dataset_files) that are now different, gone, or new."""
    now = dataset_files(root)
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))


class SkipLog:
    """The skipped samples a run has named in its log. Loader workers only record what they skip (each batch carries
    its (key, reason, detail) triples, PackedBatch.skipped_samples); this process, which sees every worker's batches
    in every epoch, logs a (key, reason) pair the first time it arrives, for the first LOGGED_PER_REASON keys of a
    reason. Later skips are counted (PackedBatch.skipped → the metrics' skipped column and the run's total)."""

    def __init__(self):
        self.logged: set[tuple[str, str]] = set()  # bounded: LOGGED_PER_REASON pairs per reason
        self.per_reason: Counter = Counter()

    def report(self, samples) -> None:
        for key, reason, detail in samples:
            if (key, reason) in self.logged or self.per_reason[reason] >= LOGGED_PER_REASON:
                continue
            self.logged.add((key, reason))
            self.per_reason[reason] += 1
            more = (f" (the first {LOGGED_PER_REASON} {reason.replace('_', ' ')} samples are named; further ones are "
                    "counted in the metrics' skipped column)") if self.per_reason[reason] == LOGGED_PER_REASON else ""
            log.warning("skipping sample %s: %s%s%s", key, reason.replace("_", " "), f" ({detail})" if detail else "",
                        more)


def next_batch(it, loader) -> PackedBatch:
    """The loader's next batch, its skipped samples logged once each (loader.skip_log); a failure in the loader as one
    DatasetError that says what to do: the dataset changed under the run, or no sample could be used in a long
    stretch, or Energon gave up on the data."""
    try:
        batch = next(it)
    except Exception as e:
        root = loader.dataset_root
        for member, stamp in loader.dataset_stamps.items():
            changed = changed_files(member, stamp)
            if changed:
                raise DatasetError(f"the dataset changed while training: {len(changed)} files of '{member}' differ "
                                   f"from when this run opened it (e.g. {changed[0]}) — let dit-prepare finish, then "
                                   "continue with --resume auto (or write the new dataset to another folder)") from None
        counts = too_many_skipped(e)
        if counts is not None:
            reasons = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in counts.most_common())
            raise DatasetError(f"no usable sample in the last {counts.total()} samples of dataset '{root}' ({reasons})"
                               " — fix the data or the settings that reject it (data.seq_length, model.patch_size), "
                               "or raise data.max_skipped_in_a_row if usable samples are rare") from None
        if isinstance(e, FatalSampleError):
            last = next((ln for ln in reversed(str(e).strip().splitlines()) if ln.strip()), type(e).__name__)
            raise DatasetError(f"reading dataset '{root}' failed: {last.strip()} — check it with "
                               "`energon lint`, or prepare it again with dit-prepare --overwrite") from None
        raise
    loader.skip_log.report(batch.skipped_samples)
    return batch


@dataclass
class LatentSample(Sample):
    latent: torch.Tensor  # [C, T, H, W]
    text: torch.Tensor  # [L, D]
    meta: dict


@dataclass
class EncodedSample(Sample):
    """A TokenSample carried through Energon (which restores its packing buffer from these samples' keys)."""

    item: TokenSample


@dataclass
class PackedSample(Sample):
    row: PackedRow


@stateless
def cook(sample: CrudeSample) -> LatentSample:
    """Energon hands over the members' raw bytes (the task encoder has no decoder); they are decoded here, by
    ditcore alone (schema.read_sample: nothing in a dataset can run code)."""
    latent, text, meta = read_sample(sample)
    return LatentSample(**basic_sample_keys(sample), latent=latent, text=text, meta=meta)


class PackingTaskEncoder(TaskEncoder):
    """Patchify with the model's own p and pt, skip bad samples (counted), pack into rows of seq_length.

    Skip counts travel with the batches (`batch.skipped`: counts since the worker's previous batch), so
    they add up correctly however many loader workers there are; so do the skipped samples' keys
    (`batch.skipped_samples`), which the main process logs once each (SkipLog). A run of `max_skipped_in_a_row` skipped
    samples without a usable one raises TooManySkipped: a dataset that is all bad stops the run instead of
    being read forever. Unreadable samples (Energon's errors, `count_error`) count as skipped too.
    """

    cookers = (Cooker(cook),)
    # Energon's default decoder would unpickle members by extension (`.pth` through torch's full unpickler,
    # `.pkl`/`.pyd` through Python's): a crafted dataset would run its code. Without one, `cook` gets raw bytes.
    decoder = None

    def __init__(self, *, patch_size: int, patch_size_t: int, seq_length: int, text_dim: int, text_multiple: int = 1,
                 max_skipped_in_a_row: int = MAX_SKIPPED_IN_A_ROW, dataset_stamps: dict | None = None,
                 inputs: type[Inputs] = Inputs, members: dict[str, Member] | None = None,
                 blend_stats: dict | None = None):
        super().__init__()
        self.inputs = inputs  # the architecture's inputs type: which per-sample conditions each sample's metadata gives
        self.p, self.pt, self.seq_length, self.text_dim = patch_size, patch_size_t, seq_length, text_dim
        self.text_multiple = text_multiple
        self.max_skipped_in_a_row = max_skipped_in_a_row
        self.dataset_stamps = dataset_stamps or {}  # root → dataset_files: to tell a dataset replaced under the run
        # a blend's datasets by name (a sample's NAME_KEY subflavor): their CFG dropout rates and the maps of their
        # latents into the blend's units (None: the same units)
        members = members or {}
        self.drop_rates = {name: m.cfg_drop for name, m in members.items()}
        self.latent_maps = {name: m.latent_map(blend_stats or {}) for name, m in members.items()}
        self._skipped: Counter = Counter()  # since the last batch
        self._skipped_samples: list[tuple[str, str, str]] = []  # (key, reason, detail) since the last batch
        self._in_a_row: Counter = Counter()  # since the last usable sample

    def _count(self, reason: str, sample_key: str, detail: str = "") -> None:
        """A worker does not log the skip (it would, again, in every worker and epoch): the batch carries it to
        the main process (SkipLog)."""
        self._skipped[reason] += 1
        self._skipped_samples.append((sample_key, reason, detail))
        self._in_a_row[reason] += 1
        if self._in_a_row.total() >= self.max_skipped_in_a_row:
            raise TooManySkipped(dict(self._in_a_row))

    def _skip(self, sample: LatentSample, reason: str, detail: str = ""):
        self._count(reason, sample.__key__, detail)
        raise SkipSample()

    def count_error(self, exc: Exception, sample, sources=None) -> None:
        """Energon's error handler: skip the unreadable sample and count it. If the dataset's files changed since
        the loader opened them (prepared again under the run), stop: the rest would be garbage too."""
        for root, stamp in self.dataset_stamps.items():
            if changed_files(root, stamp):
                raise RuntimeError(f"the dataset {root} changed while it was read") from exc
        where = f" ({sources[0].shard_name})" if sources else ""
        self._count("unreadable_sample", f"{getattr(sample, '__key__', '?')}{where}", f"{type(exc).__name__}: {exc}")

    @stateless
    def preencode_sample(self, sample: LatentSample) -> EncodedSample:
        z, text = sample.latent, sample.text
        if not torch.is_tensor(z) or z.ndim != 4:
            self._skip(sample, "latent_not_4d")
        largest = z.abs().max() if z.numel() else torch.zeros(())
        if not torch.isfinite(largest):  # one reduction for both checks: inf and NaN give an inf or NaN max
            self._skip(sample, "non_finite_latent")
        if largest > LATENT_BOUND:
            self._skip(sample, "latent_out_of_range")
        if not torch.is_tensor(text) or text.ndim != 2 or text.shape[1] != self.text_dim:
            self._skip(sample, "bad_text_states")
        if not torch.isfinite(text).all():
            self._skip(sample, "non_finite_text")
        _, T, H, W = z.shape
        if T % self.pt or H % self.p or W % self.p:
            self._skip(sample, "not_divisible_by_patch", f"latent {T}x{H}x{W}, patch {self.pt}x{self.p}x{self.p}")
        grid = (T // self.pt, H // self.p, W // self.p)
        n = grid[0] * grid[1] * grid[2]
        if n > self.seq_length:
            self._skip(sample, "longer_than_seq_length", f"{n} tokens, data.seq_length={self.seq_length}")
        self._check_conditions(sample)
        self._in_a_row.clear()
        source = (sample.__subflavors__ or {}).get(NAME_KEY, "")
        z = to_blend_units(z, self.latent_maps.get(source))  # a dataset with other statistics: into the blend's
        item = TokenSample.of(sample.__key__, z, text, sample.meta, self.p, self.pt, source=source,
                              cfg_drop=self.drop_rates.get(source))
        return EncodedSample.derive_from(sample, item=item)

    def _check_conditions(self, sample: LatentSample) -> None:
        """Skip a sample whose metadata gives a per-sample condition (a label, an fps, ...) that is not a number."""
        for spec in self.inputs.per_sample_fields().values():
            value = sample.meta.get(spec.key, spec.missing)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                self._skip(sample, "bad_metadata", f"{spec.key}={value!r}, expected a finite number")

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        groups = first_fit_decreasing([s.item.tokens.shape[0] for s in samples], self.seq_length)
        return [[samples[i] for i in group] for group in groups]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> PackedSample:
        return PackedSample.derive_from(samples[0], row=PackedRow([s.item for s in samples]))

    def batch(self, packs: list[PackedSample]) -> PackedBatch:
        batch = collate([p.row for p in packs], self.seq_length, self.text_multiple, self.inputs)
        batch.skipped, batch.skipped_samples = dict(self._skipped), self._skipped_samples
        self._skipped.clear()
        self._skipped_samples = []
        return batch


def broken_shards(root: Path) -> dict[str, str]:
    """Shards that no longer read as indexed (truncated, overwritten headers): name → reason.

    Walks only the 512-byte tar headers, seeking over payloads, and compares the samples found with
    Energon's index; cheap next to training. (tarfile reads a garbled header as the end of the archive,
    so a short count is how corruption shows.)
    """
    expected = json.loads((root / ".nv-meta" / ".info.json").read_text()).get("shard_counts", {})
    bad = {}
    for name, count in sorted(expected.items()):
        if not (root / f"{name}.idx").is_file():
            bad[name] = f"its index {name}.idx is missing"
            continue
        try:
            with tarfile.open(root / name, mode="r:") as tar:
                found = len({m.name.split(".", 1)[0] for m in tar if m.isfile()})
        except (tarfile.TarError, OSError, EOFError) as e:
            bad[name] = f"{type(e).__name__}: {e}"
            continue
        if found != count:
            bad[name] = f"{found} of its {count} indexed samples are readable"
    return bad


def _broken_shards(root: Path, top: Path) -> dict[str, str]:
    """The shards of the dataset at `root` (of the blend at `top`, or itself) to leave out, logged; refused when every
    one is broken."""
    bad = broken_shards(root)
    if bad:
        info = read_info(root)
        if _indexed_count(root, bad) == info.counts.get("samples", -1) or len(bad) == info.counts.get("shards", -1):
            name, reason = next(iter(bad.items()))
            where = f"dataset '{root}'" + (f" of blend '{top}'" if root != top else "")
            raise DatasetError(f"every shard of {where} is broken ({len(bad)}, e.g. {name}: {reason}) — "
                               "run dit-prepare again with --overwrite")
        for name, reason in bad.items():
            log.warning("leaving out broken shard %s of %s (%s)", name, root, reason)
    return bad


def _in_order(blend: list[Member], first: tuple[str, ...]) -> list[Member]:
    """The blend's datasets with those named in `first` first, in that order, then the others in the blend's."""
    known = [m for name in first for m in blend if m.name == name]
    return known + [m for m in blend if m not in known]


def _write_metadataset(root: Path, blend: list[Member], configs: dict[str, dict]) -> Path:
    """The Energon metadataset the loader opens for the blend at `root`: its datasets in the loader's order, by
    absolute path, each with its crude dataset config (and split config); named by its content, so that runs of other
    orders never share one. Every rank writes the same file; the rename is atomic."""
    text = yaml.safe_dump(metadataset(blend, None, configs), sort_keys=False)
    name = f".blend-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    folder = root if os.access(root, os.W_OK) else Path(tempfile.gettempdir())  # a read-only blend: this machine's
    path = folder / name
    if not path.is_file():
        tmp = folder / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def _blend_nodes(dataset) -> list[BlendDataset]:
    """The BlendDatasets in the tree of Energon datasets under `dataset`."""
    found, stack = [], [dataset]
    while stack:
        node = stack.pop()
        if isinstance(node, BlendDataset):
            found.append(node)
        stack += [d for d in getattr(node, "datasets", ()) or [getattr(node, "dataset", None)] if d is not None]
    return found


class GrowingBlend(BlendDataset):
    """Energon's blend, which also restores the state of a blend of its first datasets (a checkpoint's, before
    datasets were added to the blend): those continue where the state left each, the datasets added since start from
    their beginning. The state holds no weights: a change of weights restores as it is. The datasets' order is kept
    by the loader (build_loader's `first`), and so are the indices by which the state's buffers name a sample's
    dataset."""

    def restore_state(self, state) -> None:
        known = len(state["datasets"])
        if known > len(self.datasets):
            raise ValueError(f"the saved state is of a blend of {known} datasets, this one has {len(self.datasets)}")
        for dataset, dstate in zip(self.datasets[:known], state["datasets"], strict=True):
            dataset.restore_state(dstate)
        for dataset in self.datasets[known:]:
            dataset.reset_state_deep()
        self._worker_rng.restore_state(state["_worker_rng"])
        self.exhausted = [*state["exhausted"], *[False] * (len(self.datasets) - known)]


def _split_config_without(root: Path, bad: dict[str, str]) -> str:
    """Energon split config equal to the dataset's, with the broken shards excluded; returns its file name."""
    meta = root / ".nv-meta"
    split = yaml.safe_load((meta / "split.yaml").read_text())
    split["exclude"] = sorted(set(split.get("exclude") or []) | set(bad))
    name = "split-verified.yaml"
    tmp = meta / f".{name}.{os.getpid()}"
    tmp.write_text(yaml.safe_dump(split))
    os.replace(tmp, meta / name)  # every rank writes the same content; the rename is atomic
    return name


def _indexed_count(root: Path, shards) -> int:
    counts = json.loads((root / ".nv-meta" / ".info.json").read_text()).get("shard_counts", {})
    return sum(counts.get(s, 0) for s in shards)


# The files that identify a dataset's contents: dit-prepare's description, Energon's index (its shards' sample
# counts; a fresh uuid whenever the dataset is indexed again) and the split. Read in full: they are small.
_IDENTITY = ("ditcore.json", ".nv-meta/.info.json", ".nv-meta/index.uuid", ".nv-meta/split.yaml")


def dataset_fingerprint(root: Path, broken: dict[str, str]) -> dict:
    """What a loader's saved position depends on, cheaply (no sample is read): a digest of the dataset's identity
    files, every indexed shard's samples and bytes, and the shards left out as broken (name → reason). Kept in
    every checkpoint (JSON-able) and compared on resume (`compare_fingerprints`)."""
    digest = hashlib.sha256()
    for name in _IDENTITY:
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    counts = json.loads((root / ".nv-meta" / ".info.json").read_text()).get("shard_counts", {})
    shards = {name: [count, (root / name).stat().st_size if (root / name).is_file() else None]
              for name, count in sorted(counts.items())}
    return {"digest": digest.hexdigest(), "shards": shards, "broken": dict(sorted(broken.items()))}


def compare_fingerprints(saved: dict | None, now: dict, root: Path) -> tuple[str | None, str | None]:
    """(damage, difference): a shard the checkpoint's loader read that is broken now (the same dataset, damaged:
    its position cannot be restored and the data is not what it was), or how the dataset differs from the
    checkpoint's (another dataset, or the same one prepared again: the position means nothing in it). Both None:
    the same data. A checkpoint without a fingerprint (an older dit-train) counts as the same data."""
    if saved is None or now is None or saved == now:
        return None, None
    if "blend" in saved or "blend" in now:
        return _compare_blends(saved, now, root)
    damaged = {name: reason for name, reason in now["broken"].items()
               if name in saved["shards"] and name not in saved["broken"]}
    if damaged and saved["digest"] == now["digest"]:
        name, reason = next(iter(damaged.items()))
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        return (f"shard {name} of dataset '{root}' is damaged ({reason}){more}, and the checkpoint's data loader "
                "was reading it — restore the dataset from a copy, or prepare it again (dit-prepare ... "
                "--overwrite; a resume then starts a fresh pass over the new data)"), None

    def size(fp: dict) -> str:
        return f"{sum(n for n, _ in fp['shards'].values())} samples in {len(fp['shards'])} shards"

    same_counts = {k: n for k, (n, _) in saved["shards"].items()} == {k: n for k, (n, _) in now["shards"].items()}
    what = "was prepared again" if same_counts else f"now has {size(now)}, then {size(saved)}"
    return None, f"dataset '{root}' is not the one the checkpoint was trained on (it {what})"


def _compare_blends(saved: dict, now: dict, root: Path) -> tuple[str | None, str | None]:
    """compare_fingerprints of a blend: a dataset the checkpoint's loader read that is not in the blend now is refused
    (its samples' place in the state would name another dataset); a dataset damaged or prepared again as each alone;
    weights changed and datasets added keep every position (blend_note says so)."""
    if "blend" not in saved or "blend" not in now:
        was, is_ = ("a blend", "a dataset") if "blend" in saved else ("a dataset", "a blend")
        return None, f"data.path '{root}' is {is_}, the checkpoint's loader read {was}"
    then = [m["name"] for m in saved["blend"]]
    current = {m["name"]: m for m in now["blend"]}
    gone = [name for name in then if name not in current]
    if gone:
        return (f"dataset '{gone[0]}', which the checkpoint's loader read, is not in blend '{root}' any more — add it "
                "back (its weight may be small), or start a new run from this one's weights with model.init_from"
                ), None
    if [m["name"] for m in now["blend"][:len(then)]] != then:
        return None, f"the datasets of blend '{root}' are in another order than the checkpoint's"
    for m in saved["blend"]:
        damage, difference = compare_fingerprints(m["data"], current[m["name"]]["data"], Path(m["name"]))
        if damage or difference:
            where = f"dataset '{m['name']}' of blend '{root}'"
            return tuple(t and t.replace(f"dataset '{m['name']}'", where) for t in (damage, difference))
    return None, None


def blend_note(saved: dict | None, now: dict | None) -> str | None:
    """What changed in a blend since the checkpoint that keeps every dataset's position (datasets added, weights
    changed), in one line; None if nothing did or either is not a blend."""
    if not saved or not now or "blend" not in saved or "blend" not in now:
        return None
    then = {m["name"]: m["weight"] for m in saved["blend"]}
    weights = {m["name"]: m["weight"] for m in now["blend"]}
    added = [name for name in weights if name not in then]
    changed = [f"{name} {then[name]:.3g} → {w:.3g}" for name, w in weights.items()
               if name in then and not math.isclose(w, then[name], rel_tol=1e-9)]
    if not added and not changed:
        return None
    what = ([f"dataset{'s' * (len(added) > 1)} {', '.join(added)} added"] if added else []) + (
        [f"weights changed ({', '.join(changed)})"] if changed else [])
    return (f"note: the blend changed since the checkpoint: {'; '.join(what)} — every dataset the checkpoint read "
            "continues from its position, and samples are drawn by the new weights"
            + (" (an added dataset starts at its beginning)" if added else ""))


def check_samples_fit(info, root, *, patch_size: int, patch_size_t: int, seq_length: int) -> int:
    """Refuse a dataset none of whose samples fits a packed row (training would wait forever for a batch);
    return how many samples will be skipped. Uses the latent shapes dit-prepare records (older datasets: 0)."""
    shapes = latent_shapes(info)
    tokens = {s: n for s in shapes if (n := tokens_of(s, patch_size, patch_size_t)) is not None}
    fitting = sum(shapes[s] for s, n in tokens.items() if n <= seq_length)
    if shapes and not fitting:
        need = min(tokens.values(), default=None)
        fix = (f"raise data.seq_length to at least {need}" if need else
               f"no latent shape {sorted(shapes)} is divisible by the patch {patch_size_t}x{patch_size}x{patch_size}"
               " — choose other patch sizes")
        raise DatasetError(f"no sample of dataset '{root}' fits a packed row of data.seq_length={seq_length} tokens "
                           f"— {fix}")
    return sum(shapes.values()) - fitting


def _init_worker(init, worker_id: int) -> None:
    """Loader workers leave SIGTERM, SIGUSR1, SIGINT and SIGHUP to the trainer. Slurm, `docker stop`, `timeout` and
    a terminal's Ctrl-C signal a whole process group at once; torch's worker handler would then kill the workers,
    the trainer would crash on their loss, and it could not save the loader's state (which the workers hold) in
    the checkpoint it is writing.
    Workers still end with the trainer: it stops them, and they exit when it is gone."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):  # Ctrl-C and a closed terminal too
        signal.signal(sig, signal.SIG_IGN)
    if init is not None:
        init(worker_id)


class _Loader(SavableDataLoader):
    """Energon's loader, whose workers are forked from a process without garbage.
    A forked worker collects the garbage it inherits (Energon's GcDataset calls gc.collect() in it): a dead
    process group or store still waiting there would join threads that exist only in the trainer, and the
    worker would abort ("terminate called after throwing an instance of 'std::system_error'")."""

    def __iter__(self):
        if self.num_workers > 0 and self._epoch_iterator is None:  # the workers start on this iteration
            gc.collect()
        return super().__iter__()


@functools.cache
def _stop_workers_at_exit() -> None:
    """Registered once, after multiprocessing's own exit hook, so it runs first: that hook terminates daemon
    children with SIGTERM, which the workers ignore, and would then wait for them forever."""

    def stop() -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report the end we intend as an error
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()

    atexit.register(stop)


def build_loader(
    root: str | Path,
    *,
    patch_size: int,
    patch_size_t: int,
    seq_length: int,
    batch_size: int,
    num_workers: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    dp_group=None,
    shuffle_buffer_size: int = 100,
    packing_buffer_size: int | None = None,
    max_samples_per_sequence: int = 100,
    seed: int = 0,
    text_multiple: int = 1,
    max_skipped_in_a_row: int = MAX_SKIPPED_IN_A_ROW,
    inputs: type[Inputs] = Inputs,
    first: tuple[str, ...] = (),
):
    """An endless, resumable loader of PackedBatch for one data-parallel rank.

    Broken shards are left out (logged, and counted in `loader.skipped_at_start`); unreadable samples and
    bad latents are skipped and counted in each batch's `skipped`. text_multiple: each batch's text length is
    padded up to a multiple of it (compiled GPU kernels then see a few text lengths, not one per batch).
    max_skipped_in_a_row: skipped samples in a row, with no usable one, after which the loader raises
    TooManySkipped. inputs: the model's inputs type (its architecture's, DiT.inputs_class), whose per-sample
    conditions each sample's metadata gives. Iterate with `next_batch`, which turns the loader's failures into one
    DatasetError.

    `root` may be a blend's folder (ditcore.data.blend): Energon draws each sample from one of its datasets by their
    weights, and each keeps its own position in the loader's state. first: the names of the blend's datasets a
    checkpoint's loader read, in its order: they keep their places, datasets added since come after them, so that the
    checkpoint's state restores with every dataset's position kept (GrowingBlend).
    """
    root = Path(root)
    quiet.energon_buffer_bar()
    info = read_info(root)
    blend = _in_order(blend_members(root, info), first) if info.blend else []
    roots = [m.root for m in blend] or [root]
    stamps = {r: dataset_files(r) for r in roots}  # before anything is read: a later change is a dataset replaced
    broken = {r: _broken_shards(r, root) for r in roots}
    encoder = PackingTaskEncoder(patch_size=patch_size, patch_size_t=patch_size_t, seq_length=seq_length,
                                 text_dim=info.text_encoder["dim"], text_multiple=text_multiple,
                                 max_skipped_in_a_row=max_skipped_in_a_row, dataset_stamps=stamps, inputs=inputs,
                                 members={m.name: m for m in blend}, blend_stats=info.latent_stats)
    worker_config = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers,
                                 data_parallel_group=dp_group, seed_offset=seed,
                                 global_error_handler=encoder.count_error)
    settings = dict(worker_config=worker_config, batch_size=batch_size, task_encoder=encoder,
                    shuffle_buffer_size=shuffle_buffer_size, max_samples_per_sequence=max_samples_per_sequence,
                    packing_buffer_size=packing_buffer_size or 4 * batch_size)
    if blend:
        splits = {m.name: {"split_config": _split_config_without(m.root, broken[m.root])}
                  for m in blend if broken[m.root]}
        dataset = get_train_dataset(str(_write_metadataset(root, blend, splits)), **settings)
        for node in _blend_nodes(dataset):
            node.__class__ = GrowingBlend
    else:
        split = {"split_config": _split_config_without(root, broken[root])} if broken[root] else {}
        # dataset.yaml is the typed view, for Energon's CLI
        dataset = get_train_dataset(str(root), dataset_config=crude_config(root), **split, **settings)
    loader = _Loader(dataset)
    loader.worker_init_fn = functools.partial(_init_worker, loader.worker_init_fn)
    _stop_workers_at_exit()
    left_out = sum(_indexed_count(r, bad) for r, bad in broken.items())
    loader.skipped_at_start = {"broken_shard": left_out} if left_out else {}
    loader.fingerprint = dataset_fingerprint(root, broken[root]) if not blend else {
        "blend": [{"name": m.name, "weight": m.weight, "data": dataset_fingerprint(m.root, broken[m.root])}
                  for m in blend]}
    loader.dataset_root, loader.dataset_stamps, loader.blend = root, stamps, blend
    loader.skip_log = SkipLog()
    return loader
