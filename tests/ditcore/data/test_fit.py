"""dit-train's start-up report of how a dataset fits the model (ditcore.data.fit), on dataset records built here."""

from ditcore.data.fit import data_fit, fit_report
from ditcore.data.schema import DatasetInfo


def info(shapes: dict[str, int], keys: dict[str, list[str]] | None = None) -> DatasetInfo:
    counts = {"samples": sum(shapes.values()), "latent_shapes": shapes}
    if keys is not None:
        counts["latent_shape_keys"] = keys
    return DatasetInfo(codec={"kind": "patch_pca"}, latent_stats={}, text_encoder={"name": "minilm", "dim": 384},
                       latent_channels=16, spatial_factor=8, temporal_factor=1, counts=counts)


def report(data: DatasetInfo, seq_length: int = 128, patch_size: int = 4, micro_batch: int = 2) -> list[str]:
    return fit_report(data, patch_size=patch_size, patch_size_t=1, seq_length=seq_length, micro_batch=micro_batch,
                      num_workers=2)


def test_samples_the_patch_does_not_divide_are_counted_and_named():
    """The issue's photographs: 18 latents of 16x24 and three of widths 18, 19, 41, which patch 4 does not divide.
    Before, one line said '3 of 21 samples do not fit data.seq_length=128 tokens (or the patch sizes)', naming none."""
    data = info({"16x1x16x24": 18, "16x1x16x18": 1, "16x1x16x19": 1, "16x1x16x41": 1},
                {"16x1x16x24": ["a", "b", "c"], "16x1x16x18": ["coins"], "16x1x16x19": ["moon"],
                 "16x1x16x41": ["chelsea"]})
    lines = report(data)
    assert lines[0] == "data      21 samples; 3 will be skipped"
    assert lines[1] == ("skip      3 not divisible by patch (latent 16x1x16x18 by patch 1x4x4; e.g. coins, moon, "
                        "chelsea)")
    # 4 x 6 = 24 tokens each; 128 // 24 = 5 in a row, 8 of 128 tokens padding
    assert lines[2] == ("tokens    24 min, 24 median, 24 max a sample (patch 1x4x4); a row of data.seq_length=128 "
                        "holds ~5.3 samples (11 per micro-batch), padding up to ~6%")
    assert len(lines) == 3  # nothing to advise


def test_tokens_quantiles_and_samples_per_row():
    fit = data_fit(info({"16x1x8x8": 10, "16x1x16x16": 5, "16x4x32x32": 2}), patch_size=4, patch_size_t=1,
                   seq_length=128)
    assert (fit.samples, fit.used, fit.dropped) == (17, 15, {"longer_than_seq_length": 2})
    assert fit.examples == {"longer_than_seq_length": ["16x4x32x32"]}  # no keys recorded: the shape is named
    assert (fit.quantile(0), fit.quantile(0.5), fit.quantile(1)) == (4, 4, 16)
    lines = report(info({"16x1x8x8": 10, "16x1x16x16": 5, "16x4x32x32": 2}))
    assert lines[1] == ("skip      2 longer than seq length (latent 16x4x32x32: 256 tokens > data.seq_length=128; "
                        "e.g. 16x4x32x32)")
    # (10 x 4 + 5 x 16) / 15 = 8 tokens on average: 16 samples a row, both sizes fill rows exactly
    assert lines[2].endswith("holds ~16.0 samples (32 per micro-batch), padding up to ~0%")


def test_advice_when_the_loader_will_be_the_bottleneck():
    """The issue's --pca-patch 8 with --config demo: 4 tokens an image, 32 images a row, loader-bound."""
    lines = report(info({"16x1x8x8": 100}))
    assert lines[-1].startswith("advice    ~32 samples a row, 64 per micro-batch: the loader (data.num_workers=2)")
    assert not any(ln.startswith("advice") for ln in report(info({"16x1x16x16": 100})))  # 8 a row: fine


def test_advice_when_rows_are_mostly_padding_or_most_samples_are_dropped():
    padded = report(info({"16x1x40x32": 100}))  # 80 tokens: one a row, 48 of 128 tokens padding
    assert padded[-1].startswith("advice    up to 38% of each row is padding")
    dropped = report(info({"16x1x8x8": 10, "16x1x64x64": 30}))  # 256 tokens > 128
    assert dropped[0] == "data      40 samples; 30 will be skipped"
    assert dropped[-1].startswith("advice    75% of the dataset is skipped: prepare it for this model")


def test_a_dataset_without_recorded_shapes_reports_nothing():
    assert report(info({})) == []
