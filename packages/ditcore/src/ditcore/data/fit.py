"""How a dataset fits a model and a row length, from the latent shapes dit-prepare records (no sample is read):
which samples the loader will skip and why, how many tokens a sample makes, how many samples a packed row holds.
dit-train prints it at the start (`fit_report`), so a run that will drop most of its data, pad its rows or wait for
its loader says so before the first step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# A loader process cooks, patchifies and packs each sample in Python: ~3 ms a sample (one process packed ~300 small
# samples/s on a CPU core, ditcore.data.loader with 32-px latents). A row of 16 samples then costs ~50 ms of loader
# time, about what a GPU spends on a small config's row of 4k tokens; beyond it the GPU waits unless
# data.num_workers grows with it (issue 26: 64 samples a row ran loader-bound at 7-12 s a step, 114 tokens/s).
LOADER_BOUND_SAMPLES_PER_ROW = 16
WASTEFUL_PADDING = 0.25  # a quarter of every row's compute spent on padding
WASTEFUL_DROPPED = 0.5  # most of the dataset never trains
EXAMPLES = 3  # sample keys (or latent shapes) named per reason


def parse_shapes(recorded: dict) -> dict[tuple[int, ...], int]:
    """{"CxTxHxW": samples} as dit-prepare records them → {(C, T, H, W): samples}; a key that is no such shape (a
    dataset or export from elsewhere) is left out."""
    shapes = {}
    for key, n in recorded.items():
        try:
            shape = tuple(int(v) for v in str(key).split("x"))
        except ValueError:
            continue
        if len(shape) == 4:
            shapes[shape] = int(n)
    return shapes


def latent_shapes(info) -> dict[tuple[int, ...], int]:
    """(C, T, H, W) → samples of that shape, as dit-prepare recorded them (older datasets: none)."""
    return parse_shapes(info.counts.get("latent_shapes", {}))


def tokens_of(shape: tuple[int, ...], patch_size: int, patch_size_t: int) -> int | None:
    """Tokens a latent of `shape` (C, T, H, W) makes, or None where the patch sizes do not divide it."""
    _, T, H, W = shape
    if T % patch_size_t or H % patch_size or W % patch_size:
        return None
    return (T // patch_size_t) * (H // patch_size) * (W // patch_size)


@dataclass
class DataFit:
    samples: int  # in the dataset's record of shapes
    tokens: Counter  # tokens per sample → samples, of those that fit
    dropped: Counter = field(default_factory=Counter)  # reason (the loader's) → samples
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason → a few keys, or shapes where none recorded
    why: dict[str, str] = field(default_factory=dict)  # reason → the first shape's numbers

    @property
    def used(self) -> int:
        return self.tokens.total()

    def quantile(self, q: float) -> int:
        """The token count of the sample at quantile q of the used ones (sorted by tokens)."""
        rank, seen = q * (self.used - 1), 0
        for n in sorted(self.tokens):
            seen += self.tokens[n]
            if seen > rank:
                return n
        raise ValueError("no sample fits")


def data_fit(info, *, patch_size: int, patch_size_t: int, seq_length: int) -> DataFit:
    shapes, keys = latent_shapes(info), info.counts.get("latent_shape_keys", {})
    fit = DataFit(samples=sum(shapes.values()), tokens=Counter())
    for shape, count in sorted(shapes.items()):
        n = tokens_of(shape, patch_size, patch_size_t)
        if n is not None and n <= seq_length:
            fit.tokens[n] += count
            continue
        name = "x".join(map(str, shape))
        if n is None:
            reason, why = "not_divisible_by_patch", f"latent {name} by patch {patch_size_t}x{patch_size}x{patch_size}"
        else:
            reason, why = "longer_than_seq_length", f"latent {name}: {n} tokens > data.seq_length={seq_length}"
        fit.dropped[reason] += count
        fit.why.setdefault(reason, why)
        named = fit.examples.setdefault(reason, [])
        named.extend((keys.get(name) or [name])[:EXAMPLES - len(named)])
    return fit


def fit_report(info, *, patch_size: int, patch_size_t: int, seq_length: int, micro_batch: int,
               num_workers: int) -> list[str]:
    """A few lines: samples skipped (per reason, a few named), tokens per sample, samples per packed row and the
    padding they leave, and one line of advice when the run will wait for its loader or waste most of its work.
    Nothing for a dataset that recorded no latent shapes (written before dit-prepare did)."""
    fit = data_fit(info, patch_size=patch_size, patch_size_t=patch_size_t, seq_length=seq_length)
    if not fit.samples:
        return []
    lines = [f"data      {fit.samples} samples; " + (
        "all fit" if not fit.dropped else f"{fit.dropped.total()} will be skipped")]
    for reason, n in fit.dropped.most_common():
        lines.append(f"skip      {n} {reason.replace('_', ' ')} ({fit.why[reason]}; e.g. "
                     f"{', '.join(fit.examples[reason])})")
    if not fit.used:
        return lines  # check_samples_fit refuses the run and says what to change
    mean = sum(n * c for n, c in fit.tokens.items()) / fit.used
    per_row = seq_length / mean
    # Rows packed from samples of one size n hold seq_length // n of them; mixed sizes pack at least as tightly on
    # average (first-fit-decreasing fills the gaps with smaller ones), so this is an upper estimate.
    rows = {n: c / (seq_length // n) for n, c in fit.tokens.items()}
    padding = sum(r * (seq_length - (seq_length // n) * n) for n, r in rows.items()) / (seq_length * sum(rows.values()))
    lines.append(f"tokens    {fit.quantile(0)} min, {fit.quantile(0.5)} median, {fit.quantile(1)} max a sample "
                 f"(patch {patch_size_t}x{patch_size}x{patch_size}); a row of data.seq_length={seq_length} holds "
                 f"~{per_row:.1f} samples ({per_row * micro_batch:.0f} per micro-batch), padding up to "
                 f"~{padding:.0%}")
    advice = _advice(fit, per_row, padding, micro_batch, num_workers)
    if advice:
        lines.append(f"advice    {advice}")
    return lines


def _advice(fit: DataFit, per_row: float, padding: float, micro_batch: int, num_workers: int) -> str | None:
    if fit.dropped.total() > WASTEFUL_DROPPED * fit.samples:
        return (f"{fit.dropped.total() / fit.samples:.0%} of the dataset is skipped: prepare it for this model "
                "(dit-prepare --size, a size the patch divides) or change data.seq_length / model.patch_size")
    if per_row > LOADER_BOUND_SAMPLES_PER_ROW:
        return (f"~{per_row:.0f} samples a row, {per_row * micro_batch:.0f} per micro-batch: the loader "
                f"(data.num_workers={num_workers}) will likely be slower than the model; make samples larger "
                "(dit-prepare --size, a smaller dit-prepare --pca-patch or model.patch_size) or data.seq_length "
                "shorter, or raise data.num_workers")
    if padding > WASTEFUL_PADDING:
        return (f"up to {padding:.0%} of each row is padding: choose data.seq_length a multiple of the common "
                "token counts, or prepare samples of sizes that fill a row")
    return None
