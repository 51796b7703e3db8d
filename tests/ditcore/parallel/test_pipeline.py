"""Pipeline parallelism's pieces alone: the split of blocks into stages, and the 1F1B schedule on 4 gloo processes.
(The DiT through pipeline stages against one process: test_equivalence.py.)"""

import json

import pytest

from ditcore.parallel.pipeline import stage_blocks


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("depth", [7, 8, 12, 28])
def test_stages_cover_every_block_once_in_order_as_evenly_as_possible(depth, pp):
    if pp > depth:
        return
    stages = [stage_blocks(depth, pp, s) for s in range(pp)]
    assert [b for s in stages for b in s] == list(range(depth))  # consecutive, each block once, in order
    sizes = [len(s) for s in stages]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)  # the extra blocks on the later stages


@pytest.fixture(scope="module")
def schedule(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("pipe") / "results.json"
    proc = run_torchrun("pipeline_worker.py", str(out), nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # the default run has 1F1B over 2 stages with the DiT (test_equivalence.py)
@pytest.mark.parametrize("micro", ["1", "2", "4", "9"])
def test_1f1b_over_4_stages_accumulates_the_gradients_of_one_process(schedule, micro):
    """Fewer micro-batches than stages (warm-up cut short), as many, and more (the steady 1F1B phase), each of a
    different shape: every stage's gradients equal one process's. The same float32 operations in the same order on
    each stage, so only the accumulation over micro-batches could differ: a few roundings."""
    assert schedule[micro] <= 1e-6, schedule
