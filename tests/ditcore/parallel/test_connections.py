"""ditcore.parallel.connections: the CUDA_DEVICE_MAX_CONNECTIONS each layout needs, from its dims and the
environment alone (no process, no GPU)."""

import pytest

from ditcore.parallel import ParallelDims
from ditcore.parallel.connections import QUEUES, VARIABLE, apply, decide

SP = dict(sequence_parallel=True)

# layout (dims, world size, fsdp) → the collectives a value of 1 would serialise with compute
LAYOUTS = {
    "DDP over 8": ((ParallelDims(), 8, False), ["DDP's gradient all-reduces"]),
    "TP=2 + SP alone": ((ParallelDims(tp=2, **SP), 2, False), ["tensor parallelism's all-gathers and reduce-scatters"]),
    "TP=2 without SP, DDP over 2": ((ParallelDims(tp=2), 4, False),
                                    ["tensor parallelism's all-reduces", "DDP's gradient all-reduces"]),
    "FSDP over 8": ((ParallelDims(), 8, True), ["FSDP2's all-gathers and reduce-scatters"]),
    "FSDP + TP=2 + SP": ((ParallelDims(tp=2, **SP), 8, True),
                         ["tensor parallelism's all-gathers and reduce-scatters", "FSDP2's all-gathers and "
                                                                                  "reduce-scatters"]),
    "CP=2 alone": ((ParallelDims(cp=2), 2, False), ["context parallelism's key/value all-gathers"]),
    "FSDP over the CP ranks only": ((ParallelDims(cp=2), 2, True),  # dp 1: FSDP shards over dp x cp = 2
                                    ["context parallelism's key/value all-gathers",
                                     "FSDP2's all-gathers and reduce-scatters"]),
    "PP=2 alone": ((ParallelDims(pp=2), 2, False), ["the pipeline's sends and receives"]),
    "PP=2, DP=2 (gradients reduced after the schedule)": ((ParallelDims(pp=2), 4, False),
                                                          ["the pipeline's sends and receives"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_that_communicates_gets_a_queue_per_stream_and_a_warning_for_one(name):
    (dims, world, fsdp), serialised = LAYOUTS[name]
    assert decide(dims, world, fsdp, {}).set_to == str(QUEUES) == "32"  # unset: set, silently
    assert decide(dims, world, fsdp, {}).warning is None
    one = decide(dims, world, fsdp, {VARIABLE: "1"})
    assert one.set_to is None  # the user's value stands; they are told what it costs
    assert one.warning == (f"warning: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every CUDA stream in one queue, so "
                           f"{' and '.join(serialised)} cannot overlap compute — unset it (32 is then set) or set it "
                           "above 1")
    for value in ("8", "16", "32"):  # the user's choice of more than one queue is kept, without comment
        assert decide(dims, world, fsdp, {VARIABLE: value}) == decide(dims, world, fsdp, {VARIABLE: "32"})
        assert decide(dims, world, fsdp, {VARIABLE: value}).set_to is None
        assert decide(dims, world, fsdp, {VARIABLE: value}).warning is None


@pytest.mark.parametrize("env", [{}, {VARIABLE: "1"}, {VARIABLE: "8"}])
def test_one_process_has_nothing_to_overlap(env):
    action = decide(ParallelDims(), 1, False, env)
    assert action.set_to is None and action.warning is None
    assert decide(ParallelDims(), 1, True, env) == action  # FSDP over one rank shards nothing


def test_apply_sets_the_environment_it_is_given_and_returns_the_warning():
    env = {}
    assert apply(ParallelDims(tp=2, **SP), 8, True, env) is None
    assert env == {VARIABLE: "32"}
    env = {VARIABLE: "1"}
    assert apply(ParallelDims(), 8, True, env).startswith("warning: CUDA_DEVICE_MAX_CONNECTIONS=1 ")
    assert env == {VARIABLE: "1"}
    env = {}
    assert apply(ParallelDims(), 1, False, env) is None and env == {}
