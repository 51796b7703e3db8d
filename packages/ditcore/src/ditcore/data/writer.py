"""Writing a dataset: rank-sharded WebDataset tars, then Energon's index, then ditcore.json (last)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import webdataset as wds

from ditcore.data.schema import INFO_FILE, DatasetInfo, to_record

SHARD_PATTERN = "rank{rank}-%06d.tar"  # as the reference recipe: every rank writes its own shards


def start_dataset(root: Path, overwrite: bool) -> None:
    """Make `root` ready for writing. An existing dataset is replaced only with overwrite=True."""
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        if not overwrite:
            raise FileExistsError(f"output '{root}' already exists and is not empty — choose another path "
                                  "or pass --overwrite")
        # Remove the completion marker first: if we are interrupted, nothing here passes for complete.
        (root / INFO_FILE).unlink(missing_ok=True)
        shutil.rmtree(root / ".nv-meta", ignore_errors=True)
        for p in [*root.glob("rank*-*.tar"), *root.glob("rank*-*.tar.idx"), *root.glob("codec_*")]:
            p.unlink()
    root.mkdir(parents=True, exist_ok=True)


class ShardWriter:
    """Append records to this rank's shards of a dataset directory."""

    def __init__(self, root: Path, rank: int = 0, max_count: int = 1000, max_size: float = 1e9):
        pattern = str(Path(root) / SHARD_PATTERN.format(rank=rank))
        self._writer = wds.ShardWriter(pattern, maxcount=max_count, maxsize=max_size, verbose=0)
        self.count = 0
        self.bytes = 0

    def write(self, key: str, latent, text, meta: dict) -> None:
        record = to_record(key, latent, text, meta)
        self.bytes += sum(len(v) for k, v in record.items() if k != "__key__")
        self._writer.write(record)
        self.count += 1

    def close(self) -> None:
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def energon_prepare(root: Path) -> None:
    """Index the shards with Energon as a CrudeWebdataset (train split only), non-interactively."""
    cmd = [sys.executable, "-m", "megatron.energon.cli.main", "prepare", str(root), "--non-interactive",
           "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset", "--force-overwrite", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (Path(root) / ".nv-meta" / "dataset.yaml").is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"energon prepare failed for '{root}': {tail[0]}")


# Energon 7.4's `info` needs a typed sample_type and `lint` has no cookers, so neither reads a CrudeWebdataset.
# This second config describes the same shards as typed samples, for them:
#     energon info DIR --dataset-config dataset-typed.yaml;  energon lint DIR --dataset-config dataset-typed.yaml
TYPED_CONFIG = "dataset-typed.yaml"
_TYPED_YAML = """\
sample_type:
  __module__: ditcore.data.loader
  __class__: LatentSample
field_map:
  latent: latent.pth
  text: text.pth
  meta: json
"""


def finish_dataset(root: Path, info: DatasetInfo) -> None:
    """Index the shards, then write ditcore.json: from this moment the dataset counts as complete."""
    energon_prepare(root)
    (Path(root) / ".nv-meta" / TYPED_CONFIG).write_text(_TYPED_YAML)
    info.counts["shards"] = len(list(Path(root).glob("rank*-*.tar")))
    info.write(Path(root))
