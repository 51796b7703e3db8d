"""Every choice an app offers is the library's one list of it: a solver, schedule, feature network, objective
or codec added there is offered by dit-sample and dit-prepare and accepted by dit-train without another edit
(issue 42)."""

from typing import get_args

from dit_prepare import cli as prepare_cli
from dit_sample import cli, generate
from dit_train.config import EDM, FID, Flow, TrainConfig, Validation, VPSchedule
from ditcore import codecs, export
from ditcore.choices import (
    BETA_SCHEDULES,
    CODEC_NAMES,
    FEATURES,
    LOSSES,
    OBJECTIVES,
    PRECONDS,
    PREDICTIONS,
    SAMPLE_SOLVERS,
    SOLVERS,
    T_DISTRIBUTIONS,
    VAE_CLASSES,
)
from ditcore.diffusion import edm, sampler, vp
from ditcore.eval import features
from ditcore.sampling import SCHEDULES


def test_the_apps_choices_are_the_library_s_lists():
    assert [s.value for s in cli.Solver] == list(SAMPLE_SOLVERS) == [*SOLVERS, "unipc"]
    assert [s.value for s in cli.Schedule] == list(SCHEDULES)
    assert [f.value for f in cli.Features] == list(FEATURES)
    assert generate.SOLVERS is SAMPLE_SOLVERS  # Sampler.check and the Gradio radio
    assert sampler.SOLVERS is SOLVERS and features.FEATURES is FEATURES  # what the library checks against
    assert get_args(Validation.model_fields["solver"].annotation) == SAMPLE_SOLVERS


def test_dit_train_offers_the_library_s_objectives():
    choices = {name: get_args(EDM.model_fields[name].annotation) for name in ("precond", "loss", "prediction")}
    assert choices == {"precond": ("auto", *PRECONDS), "loss": ("auto", *LOSSES), "prediction": PREDICTIONS}
    assert get_args(VPSchedule.model_fields["beta_schedule"].annotation) == BETA_SCHEDULES == get_args(vp.BetaSchedule)
    assert get_args(FID.model_fields["features"].annotation) == FEATURES
    assert edm.PREDICTIONS is PREDICTIONS and export.PRECONDS is PRECONDS  # what an export is checked against
    assert get_args(TrainConfig.model_fields["objective"].annotation) == ("auto", *OBJECTIVES)
    assert export.OBJECTIVES is OBJECTIVES
    assert get_args(Flow.model_fields["t_dist"].annotation) == T_DISTRIBUTIONS


def test_dit_prepare_offers_the_library_s_codecs():
    assert codecs.VAE_CLASSES is VAE_CLASSES  # what ditcore.codecs.vae checks a class against
    assert [c.value for c in prepare_cli.CodecName] == list(CODEC_NAMES)
    assert [c.value for c in prepare_cli.VaeClass] == list(VAE_CLASSES)
