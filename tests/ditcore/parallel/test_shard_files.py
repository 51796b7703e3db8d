"""Offline consolidation of a TP=2 checkpoint's shard files equals the live consolidation."""

import torch

from ditcore import runs as runs_layout
from ditcore.parallel.consolidate import consolidate_shards
from ditcore.parallel.plan import DIT_PLAN

from .test_fabric_checkpoint import runs  # noqa: F401  (the module-scoped TP=2 training fixture)


def test_shard_files_consolidate_to_the_one_device_weights(runs):  # noqa: F811
    files = runs_layout.shard_files(runs / "checkpoint")
    assert len(files) == 2
    full = consolidate_shards([torch.load(f, weights_only=False)["model"] for f in files], DIT_PLAN)
    # the checkpoint is from step 2; the live consolidation was taken at the end (step 4): compare shapes and
    # the replicated/sharded split against the one-device model instead of values
    final = torch.load(runs / "straight.pt")["weights"]
    assert full.keys() == final.keys()
    assert all(full[k].shape == final[k].shape for k in full)
