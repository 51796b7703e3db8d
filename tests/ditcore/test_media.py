"""Writing samples: the file is complete or absent, and a failed write says why (a full disk: where, how much free)."""

import errno

import imageio.v3 as iio
import numpy as np
import pytest

from ditcore import disk, media
from ditcore.media import read_video, write_sample

CLIP = np.random.default_rng(0).integers(0, 256, (4, 16, 24, 3), dtype=np.uint8)


def test_clips_are_h264_as_imageio_writes_them_and_stills_are_lossless_png(tmp_path):
    written = write_sample(CLIP, tmp_path / "clip")
    iio.imwrite(tmp_path / "imageio.mp4", CLIP, extension=".mp4", fps=8.0, codec="libx264", pixelformat="yuv420p",
                macro_block_size=1)
    assert written == tmp_path / "clip.mp4"
    assert written.read_bytes() == (tmp_path / "imageio.mp4").read_bytes()
    still = write_sample(CLIP[:1], tmp_path / "still.mp4")
    assert still == tmp_path / "still.png" and np.array_equal(read_video(still), CLIP[:1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "imageio.mp4", "still.png"]


@pytest.mark.parametrize("frames", [4, 1], ids=["mp4", "png"])
def test_a_full_disk_is_diskfull_and_leaves_no_file(full_disk, frames):
    """On a real full disk (a tmpfs): ffmpeg, whose exit status imageio ignores, left a 0-byte mp4 that dit-sample
    reported as written; the png writer raised, then printed a second traceback from its destructor."""
    target = full_disk / "sample.mp4"
    with pytest.raises(disk.DiskFull) as caught:
        write_sample(CLIP[:frames], target)
    written = target.with_suffix(".mp4" if frames > 1 else ".png")
    assert str(caught.value) == (f"could not write {written}: the disk is full (0 bytes free in {full_disk}) — free "
                                 "some space there or write somewhere else")
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_a_write_that_runs_out_of_space_is_diskfull_and_leaves_no_file(tmp_path, monkeypatch):
    """The same without a tmpfs (no root needed): the png's write fails with ENOSPC after part of it is written."""
    real_open = open

    class FillsUp:
        def __init__(self, path, mode):
            self.file = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(media, "open", FillsUp, raising=False)
    with pytest.raises(disk.DiskFull, match=rf"^could not write {tmp_path / 'x.png'}: the disk is full \("):
        write_sample(CLIP[:1], tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


def test_ffmpeg_failing_is_an_error_with_its_reason_not_an_empty_file(tmp_path):
    """libx264 in yuv420p cannot encode an odd width: ffmpeg exits with an error, which imageio ignored."""
    with pytest.raises(OSError, match=r"^ffmpeg failed: \[libx264\] width not divisible by 2 \(15x16\)$"):
        write_sample(CLIP[:, :, :15], tmp_path / "odd.mp4")
    assert list(tmp_path.iterdir()) == []
