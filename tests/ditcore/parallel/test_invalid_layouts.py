"""Layouts that cannot work fail at start-up, on every rank, with a message naming the problem."""

import pytest

from ditcore.errors import ConfigError
from ditcore.parallel import ParallelDims


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["3", "1", "6", "16"],
                     r"model_parallel='tp\*cp\*pp = 3\*1\*1 = 3' is invalid: expected a divisor of the world size 2",
                     marks=pytest.mark.slow),  # every rank failing alike: sp-seq, kept in the default run
        pytest.param(["2", "1", "3", "16"], r"tp=2 is invalid: expected a divisor of the model's num_heads=3",
                     marks=pytest.mark.slow),  # also refused in one process: test_bad_inputs' layout case
        pytest.param(["1", "2", "4", "15"], r"seq_length=15 is invalid: expected a multiple of cp = 2",
                     marks=pytest.mark.slow),  # the same check as sp-seq, kept in the default run
        (["2", "1", "4", "15", "sp"],
         r"seq_length=15 is invalid: expected a multiple of cp\*tp \(sequence parallel\) = 2"),
    ],
    ids=["world", "heads", "cp-seq", "sp-seq"],
)
def test_every_rank_fails_with_the_message(run_torchrun, args, message):
    import re

    proc = run_torchrun("invalid_layout_worker.py", *args, timeout=120)  # a hang would time out
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(f"rank {rank}: {message}", proc.stderr), proc.stderr[-3000:]
    assert "started" not in proc.stdout


@pytest.mark.slow  # every equivalence case starts a valid layout
def test_valid_layout_starts(run_torchrun):
    proc = run_torchrun("invalid_layout_worker.py", "2", "1", "4", "16", "sp", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: started" in proc.stdout and "rank 1: started" in proc.stdout


def test_dims_resolve_and_validate():
    assert ParallelDims(tp=2).resolve(8).dp == 4
    assert ParallelDims(tp=2, cp=2, dp=2).resolve(8).dp == 2
    with pytest.raises(ConfigError, match=r"dp=3 is invalid: expected 4: tp\*cp\*pp\*dp must equal"):
        ParallelDims(tp=2, dp=3).resolve(8)
    assert ParallelDims(tp=2, pp=2).resolve(8).dp == 2
    with pytest.raises(ConfigError, match=r"pp=3 is invalid: expected at most the model's depth=2"):
        ParallelDims(pp=3).check_model(num_heads=4, depth=2)
    with pytest.raises(ConfigError, match=r"tp=0 is invalid: expected an integer >= 1"):
        ParallelDims(tp=0)
