"""Validation samples in the loggers that show media: the contact sheet (samples/grid.png) as an image and each clip
as a frame strip (TensorBoard) or a video (W&B), under the same names in both. A logger takes media by having a
`log_samples` method (MediaLogger); the CSV log has none and is passed over."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from lightning_fabric.loggers import TensorBoardLogger
from lightning_fabric.utilities.rank_zero import rank_zero_only

from dit_train.validation import Clip, Samples
from ditcore.media import contact_sheet

SHEET = "samples/grid"  # the contact sheet's name in the loggers, as its file is RUN_DIR/samples/grid.png


def clip_name(clip: Clip) -> str:
    return f"samples/{clip.name}"  # samples/00-a-red-butterfly-8f, as its mp4 is named


@runtime_checkable
class MediaLogger(Protocol):
    def log_samples(self, samples: Samples) -> None: ...


def log_samples(loggers: list, samples: Samples) -> None:
    """Hand what a validation made to every logger that shows media."""
    for logger in loggers:
        if isinstance(logger, MediaLogger):
            logger.log_samples(samples)


def frame_strip(clip: Clip) -> np.ndarray:
    """A clip's frames side by side, labelled and enlarged as the contact sheet is: (H', W', 3) uint8."""
    return contact_sheet(clip.frames[None], [clip.prompt], [f"frame {i}" for i in range(len(clip.frames))])


class TensorBoard(TensorBoardLogger):
    """Fabric's TensorBoardLogger, with the validation samples under IMAGES: the contact sheet, and each clip as a
    frame strip (TensorBoard's add_video needs moviepy, which nothing else here needs)."""

    @rank_zero_only
    def log_samples(self, samples: Samples) -> None:
        writer = self.experiment
        if samples.sheet is not None:
            writer.add_image(SHEET, samples.sheet, samples.step, dataformats="HWC")
        for clip in samples.clips:
            writer.add_image(clip_name(clip), frame_strip(clip), samples.step, dataformats="HWC")
        writer.flush()  # on disk when logged, like the scalars' CSV: whatever ends the run afterwards
