"""Every choice an app offers is the library's one list of it: a solver, schedule or feature network added there is
offered by dit-sample and accepted by dit-train without another edit (issue 42)."""

from typing import get_args

from dit_sample import cli, generate
from dit_train.config import Validation
from ditcore.choices import FEATURES, SOLVERS
from ditcore.diffusion import sampler
from ditcore.eval import features
from ditcore.sampling import SCHEDULES


def test_the_apps_choices_are_the_library_s_lists():
    assert [s.value for s in cli.Solver] == list(SOLVERS)
    assert [s.value for s in cli.Schedule] == list(SCHEDULES)
    assert [f.value for f in cli.Features] == list(FEATURES)
    assert generate.SOLVERS is SOLVERS  # Sampler.check and the Gradio radio
    assert sampler.SOLVERS is SOLVERS and features.FEATURES is FEATURES  # what the library checks against
    assert get_args(Validation.model_fields["solver"].annotation) == SOLVERS
