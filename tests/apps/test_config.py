"""The dit-train config: strict types, one ConfigError naming the dotted key, and a --print-config that loads back."""

import math
from pathlib import Path
from typing import get_args

import pytest

from dit_train.cli import find_config
from dit_train.config import CONFIGS, SHIPPED_NAMES, TrainConfig, load_config
from ditcore.errors import ConfigError

DEMO = CONFIGS / "demo.yaml"


def error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, list(overrides))
    return e.value


def test_a_nested_bad_value_names_its_dotted_key_the_value_and_the_range():
    e = error("edm.cfg_dropout=1.5")
    assert (e.key, e.value, e.allowed.split(" (")[0]) == ("edm.cfg_dropout", 1.5, "a probability in [0, 1)")
    e = error("optim.min_lr_ratio=2")
    assert (e.key, e.value, e.allowed.split(" (")[0]) == ("optim.min_lr_ratio", 2.0, "a number in [0, 1]")


def test_an_unknown_key_lists_the_known_ones():
    e = error("logging.wandb_project=demo")  # NeMo's name; here logging.wandb.project
    assert (e.key, e.value, e.allowed) == ("logging.wandb_project", "demo", "one of the known keys: every, csv, "
                                                                            "tensorboard, wandb")
    e = error("validation.heldout.sigma_min=80")
    assert (e.key, e.value) == ("validation.heldout.sigma_min", 80.0)
    e = error("trian.steps=3")
    assert e.key == "trian" and e.allowed.startswith("one of the known keys: objective, model, data, parallel, optim, "
                                                     "edm, flow")


@pytest.mark.parametrize("raw", ["inf", ".inf", "-.inf", ".nan", "nan", "1e999"])
def test_infinite_and_nan_numbers_are_rejected(raw):
    e = error(f"optim.lr={raw}")
    assert e.key == "optim.lr" and e.allowed == "a finite number" and not math.isfinite(e.value)


def test_an_exponent_without_a_dot_is_a_number(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-3 as the string '1e-3', in a file as on the command line
    assert load_config(DEMO, ["optim.lr=1e-3", "validation.guidance=1e1"]).optim.lr == 0.001
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  betas: [0.9, 95e-2]\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.betas) == (3e-4, [0.9, 0.95]) and type(cfg.optim.lr) is float


def test_an_int_is_read_as_a_float_where_a_number_is_expected():
    cfg = load_config(DEMO, ["optim.lr=1", "optim.weight_decay=0"])
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1.0, 0.0) and type(cfg.optim.weight_decay) is float


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("train.steps=true", "an integer"),  # a bool is not an int
        ("train.steps='5'", "an integer"),  # nor is a string of digits
        ("train.steps=5.0", "an integer"),
        ("model.qk_norm=1", "true or false"),  # an int is not a bool
        ("model.qk_norm='true'", "true or false"),
        ("optim.lr=true", "a finite number"),
        ("optim.lr=abc", "a finite number"),
        ("data.path=3", "a string (a dataset written by dit-prepare)"),
        ("model.pos_embed=learned", "one of 'rope', 'sincos', 'sincos_2d'"),
        ("data.packing_buffer=x", "an integer, or null (samples considered together for packing; "
                                  "default 4 × micro_batch)"),
    ],
)
def test_types_are_strict(override, allowed):
    assert error(override).allowed == allowed


@pytest.mark.parametrize(
    ("override", "key", "value", "allowed"),
    [
        ("validation.prompts=[a red butterfly, '  ']", "validation.prompts[1]", "  ", "a non-empty prompt"),
        ("validation.prompts=[a red butterfly, 3]", "validation.prompts[1]", 3, "a string"),
        ("optim.betas=[0.9, 1.5]", "optim.betas[1]", 1.5, "a number in [0, 1)"),
        ("model.max_grid=[4, 0, 8]", "model.max_grid[1]", 0, "an integer >= 1"),
        ("optim.betas=[0.9]", "optim.betas", [0.9], "two numbers in [0, 1)"),
    ],
)
def test_a_bad_list_item_is_named_by_its_index(override, key, value, allowed):
    e = error(override)
    assert (e.key, e.value, e.allowed) == (key, value, allowed)


def test_rules_across_fields_and_presets_name_their_key():
    e = error("train.micro_batch=3")
    assert (e.key, e.value, e.allowed) == ("train.global_batch", 8, "a multiple of train.micro_batch=3")
    assert error("model.preset=DiT-XXL").allowed.startswith("one of DiT-S/2, ")
    e = error("parallel.fsdp_shard=2")  # HSDP's groups say how FSDP shards: nothing without it
    assert (e.key, e.value) == ("parallel.fsdp_shard", 2) and e.allowed.startswith("null without parallel.fsdp=true")


def test_only_the_first_error_is_reported():
    assert error("model.pos_embed=learned", "train.steps=0").key == "model.pos_embed"


@pytest.mark.parametrize("args", [["--config", "demo", "train.steps=123", "optim.lr=3e-4"], []])
def test_print_config_is_the_yaml_of_the_config_and_loads_back_equal(cli_in_process, tmp_path, args):
    proc = cli_in_process("train", *args, "--print-config")
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = load_config(DEMO, ["train.steps=123", "optim.lr=3e-4"]) if args else TrainConfig()
    assert proc.stdout == cfg.to_yaml()
    path = tmp_path / "resolved.yaml"
    path.write_text(proc.stdout)
    again = load_config(path)
    assert again == cfg and again.to_yaml() == proc.stdout


def test_shipped_configs_are_the_files_in_the_configs_folder(cli_in_process, tmp_path, monkeypatch):
    assert set(SHIPPED_NAMES) == {p.stem for p in CONFIGS.glob("*.yaml")} >= {"demo", "mock"}
    assert all(find_config(name) == CONFIGS / f"{name}.yaml" for name in SHIPPED_NAMES)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mock").mkdir()  # a dataset folder of the same name, where dit-train runs
    (tmp_path / "demo").write_text("model: {}\n")  # a file of the same name is the user's config
    assert (find_config("mock"), find_config("demo")) == (CONFIGS / "mock.yaml", Path("demo"))
    monkeypatch.setenv("COLUMNS", "1000")  # the whole list on one line
    help_text = cli_in_process("train", "--help").stdout
    assert "shipped config name: " + ", ".join(SHIPPED_NAMES) + "." in help_text


def test_sections_are_mutable_and_defaults_are_not_shared():
    a, b = TrainConfig(), TrainConfig()
    a.train.steps = 5
    a.optim.betas.append(0.5)
    assert (b.train.steps, b.optim.betas) == (1000, [0.9, 0.999])


def test_prepare_vae_class_choices_are_the_codec_s_classes():
    from dit_prepare.cli import VaeClass
    from ditcore.codecs import VAE_CLASSES

    assert tuple(VaeClass) == VAE_CLASSES


def test_model_arch_is_the_preset_s_unless_given():
    """The preset names its architecture; model.arch, when given, must agree (its choices: ditcore.models.ARCHS)."""
    assert load_config(DEMO, ["model.preset=MovieGen-Tiny"]).model.arch == "moviegen"
    assert load_config(DEMO, ["model.arch=stdit", "model.preset=ST-DiT-Tiny"]).model.arch == "stdit"
    e = error("model.arch=moviegen", "model.preset=ST-DiT-Tiny")
    assert (e.key, e.allowed) == ("model.preset", "a size of model.arch=moviegen: one of MovieGen-1B, MovieGen-5B, "
                                                  "MovieGen-30B, MovieGen-Tiny")
    assert error("model.arch=llama").allowed.startswith("one of 'dit', 'stdit', 'moviegen', 'wan' (dit: the DiT "
                                                        "(adaLN-Zero);")


def test_model_depth_overrides_the_preset_s_number_of_blocks():
    from dit_train.train import model_config
    from ditcore.data.schema import DatasetInfo
    from ditcore.models import PRESETS

    info = DatasetInfo(codec={"kind": "none"}, latent_stats={}, text_encoder={"name": "mock", "dim": 4096},
                       latent_channels=16, spatial_factor=1, temporal_factor=1)
    cfg = model_config(load_config(DEMO, ["model.preset=DiT-7B", "model.depth=4"]), info)
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.text_dim) == (4, 3072, 24, 4096)
    assert model_config(load_config(DEMO, ["model.preset=DiT-7B"]), info).depth == PRESETS["DiT-7B"].depth == 32
    e = error("model.depth=0")
    assert (e.key, e.value, e.allowed) == ("model.depth", 0, "an integer >= 1, or null (overrides the preset's "
                                                             "number of blocks)")


def test_a_layout_written_as_overrides_reads_back_as_the_same_layout():
    """dit_train.config.LAYOUT_KEYS, read both ways: a searched layout's changes as overrides, and the config they make
    as a Layout; a field that ditcore's Layout refuses is named by its key."""
    from dataclasses import fields

    from dit_train.config import LAYOUT_KEYS, memory_layout, overrides
    from ditcore.job import Layout
    from ditcore.speed import SEARCHED, changes

    assert set(LAYOUT_KEYS) <= {f.name for f in fields(Layout)} and set(SEARCHED) <= set(LAYOUT_KEYS)
    base = memory_layout(load_config(DEMO), 8, 0)
    lay = base.replace(tp=2, sequence_parallel=True, fsdp=True, fsdp_shard=2, fsdp_sync="step",
                       activation_checkpointing="block", micro_batch=2)
    written = overrides(changes(lay, base))
    assert "parallel.fsdp_shard=2" in written and "parallel.sequence_parallel=true" in written
    back = memory_layout(load_config(DEMO, written), 8, 0)
    assert {f: getattr(back, f) for f in SEARCHED} == {f: getattr(lay, f) for f in SEARCHED}
    with pytest.raises(ConfigError) as e:
        memory_layout(load_config(DEMO, ["parallel.fsdp=true", "parallel.fsdp_shard=3"]), 4, 0)
    assert (e.value.key, e.value.value) == ("parallel.fsdp_shard", 3)


def test_the_config_offers_the_layout_s_choices():
    """Each layout key of the config takes what ditcore.job.Layout takes (ditcore.choices.LAYOUT_CHOICES, the one list
    both read), and `auto` where dit-train decides."""
    from dit_train.config import LAYOUT_KEYS, TrainConfig
    from ditcore.choices import LAYOUT_CHOICES

    for field, allowed in LAYOUT_CHOICES.items():
        if field in LAYOUT_KEYS:
            section, name = LAYOUT_KEYS[field].split(".")
            offered = set(get_args(TrainConfig.model_fields[section].annotation.model_fields[name].annotation))
            assert offered - {"auto"} == set(allowed), field
