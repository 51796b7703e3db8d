"""model.init_from: a new model's first weights from another's, by name and shape, in every layout.

The source is a 2-block DiT-Tiny; the target has 3 blocks (and, in some tests, wider text states): blocks 0-1, the
embedders and the final layer are copied exactly, block 2 (and the wider text projection) keep the fresh init.
TP=2 runs in this process on torch's fake process-group backend (copying runs no collective); the 2-process test runs
TP, FSDP and pipeline layouts on gloo. The staged recipe's step (dit-7b-stage1 → stage2 → stage3): the same
architecture on longer rows and a larger grid, started from the previous stage's checkpoint."""

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from ditcore import runs
from ditcore.errors import ConfigError
from ditcore.export import WEIGHTS
from ditcore.init_from import copy_in, match, start_from
from ditcore.inputs import Inputs
from ditcore.layout import grid_rows
from ditcore.models import DiT, preset
from ditcore.parallel import ParallelDims, ParallelGroups, materialize, parallelize
from ditcore.parallel.tensor_parallel import is_tp_sharded
from ditcore.testing import assert_close_fp32, dit_forward_work, fp32_tolerance

from .parallel.conftest import torchrun
from .parallel.init_from_worker import FRESH_SEED, LAYOUTS, TARGET

SOURCE = preset("DiT-Tiny", in_channels=4, text_dim=16)  # 2 blocks


def weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    model = DiT(cfg)
    model.init_weights(seed)
    return model.state_dict()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An export folder (its weights file is all init_from reads of one) holding the source's weights."""
    folder = tmp_path_factory.mktemp("source")
    save_file(weights(SOURCE, 1), str(folder / WEIGHTS))
    return folder


def one_line(text: str, *fragments: str) -> None:
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def check_started_from(got: dict[str, torch.Tensor], src: dict[str, torch.Tensor], target=TARGET) -> None:
    """Every tensor the source has with the same shape is the source's, exactly; every other is the fresh init."""
    fresh = weights(target, FRESH_SEED)
    assert got.keys() == fresh.keys()
    taken = 0
    for k, v in got.items():
        if k in src and src[k].shape == v.shape:
            assert torch.equal(v, src[k]), k
            taken += 1
        else:
            assert torch.equal(v, fresh[k]), k
    assert taken and taken < len(got)
    k = "blocks.0.attn.qkv.weight"  # the check could not pass by accident: fresh and source differ
    assert not torch.allclose(src[k], fresh[k], atol=1e-3)


SUMMARY = "58 of 80 tensors (x_embedder, t_embedder, text_embedder, blocks 0-1 of 3, final); fresh: blocks 2 of 3 " \
          "(not in the source)"


def test_a_deeper_model_takes_every_matching_tensor_and_says_which(source):
    model = materialize(meta(TARGET), FRESH_SEED, "cpu")
    line = start_from(source, TARGET, [model], None)
    assert line == f"init_from {source}: {SUMMARY}"
    check_started_from(model.state_dict(), weights(SOURCE, 1))


def test_a_model_with_other_shapes_takes_the_rest_and_names_what_differs():
    """Text states 8 wide in the source, 16 here; the source also has a block more and no QK norms."""
    src = weights(preset("DiT-Tiny", in_channels=4, text_dim=8, depth=4, qk_norm=False), 1)
    found = match(src, {k: v.shape for k, v in meta(TARGET).state_dict().items()})
    line = found.summary("S")
    one_line(line, "init_from S: 67 of 80 tensors (x_embedder, t_embedder, final; in part: text_embedder, "
                   "blocks 0-2 of 3); fresh: text_embedder.0.weight (the source's is [64, 8], this model's [64, 16]), "
                   "blocks.0.attn.q_norm.weight (not in the source)", "and 10 more tensors",
             "; not used: 18 of the source's tensors (blocks 3)")
    model = materialize(meta(TARGET), FRESH_SEED, "cpu")
    copy_in(model, {k: src[k] for k in found.taken}, None)
    check_started_from(model.state_dict(), src)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_takes_its_shard_of_the_source(source, rank):
    src = weights(SOURCE, 1)
    with fake_tp(rank) as groups:
        model = materialize(parallelize(meta(TARGET), groups), FRESH_SEED, "cpu", groups)
        start_from(source, TARGET, [model], groups)
    fresh, params, sharded = weights(TARGET, FRESH_SEED), dict(model.named_parameters()), 0
    for k, v in model.state_dict().items():
        full = src[k] if k in src else fresh[k]
        want = full.chunk(2, dim=params[k].partition_dim)[rank] if is_tp_sharded(params[k]) else full
        assert torch.equal(v, want), k
        sharded += is_tp_sharded(params[k]) and k in src
    assert sharded == 13 * SOURCE.depth + 2  # per block 11 attention, cross-attention and MLP tensors and adaLN's 2;
    #                                          the final layer's adaLN's 2


@pytest.mark.slow  # 42 s on 2 cores: make test-slow, which CI runs
def test_every_layout_starts_from_the_same_weights_on_two_processes(source, tmp_path):
    """TP=2 + SP, FSDP over DP=2, TP=2 + FSDP and two pipeline stages, each consolidated after init_from."""
    proc = torchrun("init_from_worker.py", str(source), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = json.loads((tmp_path / "lines.json").read_text())
    assert lines == {name: f"init_from {source}: {SUMMARY}" for name in LAYOUTS}  # the whole model on every layout
    for name in LAYOUTS:
        check_started_from(torch.load(tmp_path / f"{name}.pt", weights_only=True), weights(SOURCE, 1))


def test_a_source_with_nothing_in_common_is_refused_in_one_line(tmp_path):
    save_file({"encoder.weight": torch.zeros(3, 3), "blocks.0.attn.qkv.weight": torch.zeros(5, 5)},
              str(tmp_path / WEIGHTS))
    with pytest.raises(ConfigError) as e:
        start_from(tmp_path, TARGET, [], None)
    one_line(str(e.value), f"model.init_from='{tmp_path}' is invalid", "none of the source's 2 tensors has the name "
             "and shape of one of this model's 80", "unset model.init_from")


def test_non_finite_or_damaged_or_unknown_sources_are_refused_in_one_line(tmp_path):
    src = weights(SOURCE, 1)
    src["final.linear.weight"][0, 0] = float("nan")
    save_file(src, str(tmp_path / WEIGHTS))
    with pytest.raises(ConfigError) as e:
        start_from(tmp_path, TARGET, [], None)
    one_line(str(e.value), "finite weights", "NaN/Inf in 1 tensors (e.g. final.linear.weight)", "earlier checkpoint")

    data = (tmp_path / WEIGHTS).read_bytes()
    (tmp_path / WEIGHTS).write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError) as e:
        start_from(tmp_path, TARGET, [], None)
    one_line(str(e.value), "weights that load", "is truncated or damaged")

    for path in (tmp_path / "empty", tmp_path / "missing"):
        if path.name == "empty":
            path.mkdir()
        with pytest.raises(ConfigError) as e:
            start_from(path, TARGET, [], None)
        one_line(str(e.value), f"model.init_from='{path}' is invalid", "a training checkpoint (RUN_DIR/checkpoints/"
                 "step-XXXXXXX", "a run directory", "an export folder (model.safetensors + model.json)")


def meta(cfg) -> DiT:
    with torch.device("meta"):
        return DiT(cfg)


@contextlib.contextmanager
def fake_tp(rank: int, tp: int = 2):
    """The ParallelGroups that `rank` of a TP=`tp` layout gets, with no other process (as test_materialize)."""
    dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    try:
        world = dist.group.WORLD
        yield ParallelGroups(dims=ParallelDims(tp=tp, sequence_parallel=True).resolve(tp), tp_group=world,
                             cp_group=world, dp_group=world, dp_cp_group=world, tp_rank=rank, cp_rank=0, dp_rank=0,
                             dp_cp_rank=0)
    finally:
        dist.destroy_process_group()


def test_a_foreign_dit_checkpoint_brings_its_architecture_schedule_and_latent_scale(tmp_path):
    """An original DiT file (its state-dict layout, built as DiT's models.py names it) and a diffusers pipeline with a
    VAE of another scaling_factor: read as sources, copied in whole."""
    from ditcore import interop
    from ditcore.diffusion.vp import DiscreteVP
    from ditcore.init_from import read_source
    from ditcore.layout import SIGMA_DATA

    from .test_interop import as_original_dit, diffusers_dit_model, original_state_dict

    theirs = as_original_dit(diffusers_dit_model(num_attention_heads=6, attention_head_dim=64, seed=7))
    torch.save(original_state_dict(theirs), tmp_path / "DiT-S-2-tiny.pt")
    src = read_source(tmp_path / "DiT-S-2-tiny.pt")
    imported = interop.read(tmp_path / "DiT-S-2-tiny.pt")
    assert src.cfg == imported.cfg and src.vp == DiscreteVP() and src.kind == "DiT checkpoint"
    assert src.latent_stats.mean.tolist() == [0.0] * 4
    assert src.latent_stats.std.tolist() == [pytest.approx(SIGMA_DATA / 0.18215)] * 4  # DiT's 0.18215 z
    model = DiT(src.cfg)
    line = start_from(tmp_path / "DiT-S-2-tiny.pt", src.cfg, [model], None, source=src)
    assert line == (f"init_from {tmp_path / 'DiT-S-2-tiny.pt'}: 31 of 31 tensors (x_embedder, t_embedder, "
                    "y_embedder, blocks 0-1 of 2, final)")
    assert all(torch.equal(v, imported.tensors[k]) for k, v in model.state_dict().items())

    pipe = tmp_path / "pipe"
    theirs.save_pretrained(pipe / "transformer")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    (pipe / "vae").mkdir()
    (pipe / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "scaling_factor": 0.13025,
                                                          "shift_factor": 0.0609}))
    stats = read_source(pipe).latent_stats  # (z − 0.0609)·0.13025, as the pipeline's VAE says
    assert stats.mean.tolist() == [pytest.approx(0.0609)] * 4
    assert stats.std.tolist() == [pytest.approx(SIGMA_DATA / 0.13025)] * 4


def test_an_export_of_a_vp_run_is_a_source_with_its_schedule_and_latent_stats(tmp_path):
    """What a run fine-tuned under VP preconditioning exports (model.json: precond vp and its schedule; ditcore.json:
    the network's latent stats) is what a run started from it reads back; an EDM export brings neither."""
    from ditcore.codecs import LatentStats
    from ditcore.data.schema import DatasetInfo
    from ditcore.diffusion.vp import DiscreteVP
    from ditcore.export import export_model
    from ditcore.init_from import read_source

    data = tmp_path / "data"
    data.mkdir()
    DatasetInfo(codec={"kind": "none"}, latent_stats={"mean": [0.1] * 4, "std": [2.0] * 4},
                text_encoder={"name": "minilm", "dim": 16}, latent_channels=4, spatial_factor=8,
                temporal_factor=1).write(data)
    vp = DiscreteVP(timesteps=500, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    stats = LatentStats(torch.zeros(4), torch.full((4,), 2.745))
    state = weights(SOURCE, 1)
    export_model(tmp_path / "vp", state, SOURCE, data, extra={"precond": "vp", "vp": vp.to_dict()},
                 latent_stats=stats)
    src = read_source(tmp_path / "vp")
    assert src.vp == vp and src.cfg is None and src.latent_stats.std.tolist() == [pytest.approx(2.745)] * 4
    assert src.recorded() == {"precond": "vp", "vp": vp.to_dict(), "latent_stats": stats.to_dict()}
    export_model(tmp_path / "edm", state, SOURCE, data)
    edm = read_source(tmp_path / "edm")
    assert edm.vp is None and edm.latent_stats is None and edm.recorded() == {}


# ---------------------------------------------------------------- stages (issue 44)

# Stage 1 trains on rows of two images of 4x4 tokens (32 tokens); the next stage, started from it, on rows of 256
# tokens holding clips of up to 4 frames of 8x8 tokens. The same architecture: only max_grid, the bound positions are
# checked against, grows (dit-train's model.max_grid; the shipped stages keep the preset's (64, 256, 256)).
STAGE1 = SOURCE.replace(max_grid=(1, 4, 4))
STAGE2 = SOURCE.replace(max_grid=(4, 8, 8))
TEXT = 3  # text tokens of each sample


def trained(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Weights as training leaves them: off their initialisation, whose zero gates and output layer would make every
    output zero and every comparison below vacuous."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in weights(cfg, seed).items()}


def save_checkpoint(run_dir, step: int, model: dict, ema: dict, optim: dict):
    """A checkpoint as dit-train writes it (dit_train.checkpoint's sequence, through ditcore.runs): the model's, the
    EMA's and AdamW's tensors and the values, sealed and published in the run directory."""
    final = runs.begin_step(run_dir, step)
    tmp = runs.tmp_dir(final)
    runs.save_tensors(tmp, runs.checkpoint_tensors(model, ema, optim), {"step": step})
    runs.publish(tmp, final, step, {"world_size": 1}, runs.seal(tmp, runs.files_of_rank(tmp, 0)), None)
    return final


def sample(cfg, grid, g) -> dict:
    tokens = grid[0] * grid[1] * grid[2]
    return {"grid": grid, "x": torch.randn(tokens, cfg.patch_dim, generator=g),
            "c_noise": torch.randn((), generator=g), "text": torch.randn(TEXT, cfg.text_dim, generator=g)}


def row(samples: list[dict], N: int, shifts=None) -> tuple[torch.Tensor, torch.Tensor, Inputs]:
    """One row of N tokens packing `samples` (then padding) as the loader packs them, each with its own noise level
    and text; a sample's positions start at its shift (t, h, w) (the loader's: (0, 0, 0))."""
    seg, pos = grid_rows([[s["grid"] for s in samples]], N)
    x, text = torch.zeros(1, N, samples[0]["x"].shape[1]), torch.cat([s["text"] for s in samples])[None]
    for i, (s, shift) in enumerate(zip(samples, shifts or [(0, 0, 0)] * len(samples), strict=True)):
        x[0, seg[0] == i] = s["x"]
        pos[0, seg[0] == i] += torch.tensor(shift)
    text_seg = torch.arange(len(samples)).repeat_interleave(TEXT)[None]
    c_noise = torch.stack([s["c_noise"] for s in samples])[None]
    return x, c_noise, Inputs(pos, seg=seg, text=text, text_seg=text_seg)


def model_with(cfg, state: dict) -> DiT:
    model = DiT(cfg)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("pos_embed", ["rope", "sincos"])
def test_the_next_stage_starts_from_the_previous_one_on_longer_rows_and_larger_grids(tmp_path, pos_embed):
    """No tensor of the DiT depends on the grid or the row length: positions are computed from each token's integer
    (t, h, w), as RoPE's rotation angles or the fixed sin-cos table, never looked up in a learned one. So init_from
    takes every tensor of stage 1's run (its newest checkpoint's EMA weights, into the model and its EMA alike; not
    the checkpoint's raw model weights, nor AdamW's state), stage 2 computes on stage 1's rows exactly what stage 1
    computed, and on its own longer rows and larger grids it runs with nothing extended."""
    one, two = STAGE1.replace(pos_embed=pos_embed), STAGE2.replace(pos_embed=pos_embed)
    model, ema = trained(one, 2), trained(one, 3)
    optim = {f"{k}.{m}": torch.rand(v.shape) for k, v in model.items() for m in ("exp_avg", "exp_avg_sq")}
    ckpt = save_checkpoint(tmp_path / "stage1", 1000, model, ema, optim)
    g = torch.Generator().manual_seed(4)
    images = [sample(one, (1, 4, 4), g), sample(one, (1, 4, 4), g)]
    stage1 = model_with(one, ema)  # what stage 1 hands on: its EMA weights
    with torch.no_grad():
        before = stage1(*row(images, 32))

    modules = [materialize(meta(two), FRESH_SEED, "cpu") for _ in ("model", "ema")]
    line = start_from(tmp_path / "stage1", two, modules, None)  # model.init_from=RUN_DIR, as the shipped stages
    assert line == f"init_from {ckpt}: 58 of 58 tensors (x_embedder, t_embedder, text_embedder, blocks 0-1 of 2, final)"
    for module in modules:
        assert all(torch.equal(v, ema[k]) for k, v in module.state_dict().items())
    k = "blocks.0.attn.qkv.weight"  # not vacuous: the checkpoint's model, its EMA and a fresh init all differ
    assert not torch.allclose(model[k], ema[k], atol=1e-2) and not torch.allclose(ema[k], weights(two, FRESH_SEED)[k],
                                                                                     atol=1e-2)
    stage2 = modules[0].eval()
    with torch.no_grad():
        assert torch.equal(stage2(*row(images, 32)), before)  # the same model, bitwise

        # A clip of 3 frames of 8x8 tokens: positions beyond stage 1's grid, which stage 1 refuses and stage 2 takes.
        # Stage 2's row packs it after the two images in 256 tokens (224 and padding); each sample attends to its own
        # tokens only (the masked keys add exact zeros), so each computes what it computes alone: the images what
        # stage 1 computed on them
        clip = sample(two, (3, 8, 8), g)
        with pytest.raises(ValueError, match=r"token position T=2 is outside the model's range 0..0 \(max_grid=\(1, "):
            stage1(*row([clip], 192))
        packed = stage2(*row([*images, clip], 256))
        work = dit_forward_work(two, seq_len=256, text_len=3 * TEXT)
        assert_close_fp32(packed[:, :32], before, work=work)
        assert_close_fp32(packed[:, 32:224], stage2(*row([clip], 192)), work=work)
        assert (packed[:, 32:224] - clip["x"]).abs().mean() > 0.1  # the clip's output is not its input

        if pos_embed == "rope":
            # RoPE rotates queries and keys by their own positions, so attention sees only offsets between tokens:
            # the images placed beyond stage 1's grid compute what they computed at its origin, up to the rounding
            # of their angles (positions ≤ 7 times frequencies ≤ 1: ≤ 7 rad, rounded within 7 ε) in each block's
            # queries and keys, counted as reductions of that length
            shifted = row(images, 32, [(2, 4, 4), (1, 0, 4)])
            top = int(shifted[2].pos.max())
            moved = stage2(*shifted)
            work = dit_forward_work(two, seq_len=32, text_len=2 * TEXT) + two.depth * 2 * top
            assert_close_fp32(moved, before, work=work)
            # Not vacuous: positions matter. With the first image's tokens in reverse order on the same positions, a
            # model blind to positions would give its outputs reversed; this one is far off them
            reversed_ = [dict(images[0], x=images[0]["x"].flip(0)), images[1]]
            off = (stage2(*row(reversed_, 32))[:, :16] - before[:, :16].flip(1)).abs().max().item()
            assert off > 100 * fp32_tolerance(work, before.abs().max().item())
