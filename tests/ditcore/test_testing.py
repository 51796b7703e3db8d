import pytest
import torch

from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import DiT, preset
from ditcore.testing import EPS32, HostReads, NoLowPrecisionScatter, assert_close_fp32, dit_forward_work, fp32_tolerance


@pytest.mark.parametrize("n", [1, 16, 384, 4096])
def test_dot_product_error_is_within_the_bound(n):
    # Higham's bound is relative to Σ|x_i·y_i|; 200 trials each in float32 against float64
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(200, n, generator=g), torch.randn(200, n, generator=g)
    got = (x * y).sum(1, dtype=torch.float32).double()
    terms = x.double() * y.double()
    exact, scale = terms.sum(1), terms.abs().sum(1)
    assert ((got - exact).abs() <= fp32_tolerance(n, 1.0) * scale).all()
    matmul = (x[:, None, :] @ y[:, :, None]).flatten().double()  # BLAS' own blocked order
    assert ((matmul - exact).abs() <= fp32_tolerance(n, 1.0) * scale).all()


def test_dit_forward_is_within_its_bound_of_float64():
    # sincos: in float64 the model then computes in float64 throughout (RoPE would rotate in float32)
    cfg = preset("DiT-Tiny", text_dim=24, num_classes=5, fps_cond=True, pos_embed="sincos")
    model = DiT(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the (partly zero) initialisation, so every path contributes
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    inputs = (torch.randn(2, 16, cfg.patch_dim, generator=g), torch.randn(2, 1, generator=g), grid_positions((1, 4, 4)))
    cond = dict(class_labels=torch.tensor([[1], [4]]), fps=torch.tensor([[8.0], [24.0]]),
                text=torch.randn(2, 7, 24, generator=g))
    with torch.no_grad():
        out32 = model(*inputs[:2], Inputs(inputs[2], **cond))
        exact = model.double()(inputs[0].double(), inputs[1], Inputs(inputs[2], **{
            k: v.double() if v.is_floating_point() else v for k, v in cond.items()}))
    assert_close_fp32(out32.double(), exact, work=dit_forward_work(cfg, seq_len=16, text_len=7))


def test_assert_close_fp32_catches_a_relative_error_of_1e_3():
    expected = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert_close_fp32(expected * (1 + 4 * EPS32), expected, work=8)
    with pytest.raises(AssertionError, match=r"float32 bound: work 1000"):
        assert_close_fp32(expected * (1 + 1e-3), expected, work=1000)


# The backwards of a gather, an index_select and an advanced index scatter-add; an index_put adds only when told to
SCATTERING = {
    "gather": (lambda v, i: torch.gather(v, 0, i[:, None].expand(-1, v.shape[1])), r"scatter_add.* GatherBackward0"),
    "index_select": (lambda v, i: v.index_select(0, i), r"index_add.* IndexSelectBackward0"),
    "advanced_index": (lambda v, i: v[i], r"index_put.* IndexBackward0"),
    "index_put_accumulate": (lambda v, i: torch.zeros_like(v).index_put((i[:3],), v[:3], accumulate=True), "forward"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", SCATTERING)
def test_no_low_precision_scatter_finds_sums_into_bf16_and_fp16(op, dtype):
    take, where = SCATTERING[op]
    values = torch.randn(4, 3, dtype=dtype, requires_grad=True)
    index = torch.tensor([0, 2, 2, 1, 0])
    with pytest.raises(AssertionError, match=rf"{where}.*: into {dtype} \(4, 3\)"), NoLowPrecisionScatter():
        take(values, index).sum().backward()


@pytest.mark.parametrize("op", SCATTERING)
def test_no_low_precision_scatter_lets_fp32_sums_and_plain_writes_pass(op):
    take, _ = SCATTERING[op]
    index = torch.tensor([0, 2, 2, 1, 0])
    with NoLowPrecisionScatter():
        take(torch.randn(4, 3, requires_grad=True), index).sum().backward()  # fp32: CUDA accumulates in fp32
        x = torch.zeros(4, 3, dtype=torch.bfloat16)
        x[index[:2]] = 1.0  # an index_put without accumulate writes, it does not sum
        x.index_put_((index[:2],), torch.ones(2, 3, dtype=torch.bfloat16))


# What makes the host wait for a CUDA tensor (torch.cuda.set_sync_debug_mode("error") raises on each), and what does
# not: HostReads must flag the first on the CPU and let the second through.
x = torch.linspace(-1.0, 1.0, 6)
F = torch.nn.functional
WAITS = {
    "item": lambda: x.sum().item(),
    "float": lambda: float(x[0]),
    "bool": lambda: bool(x.sum() > 0),
    "if any": lambda: 1 if (x > 0).any() else 0,
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "equal": lambda: torch.equal(x, x),
    "nonzero": lambda: x.nonzero(),
    "where(mask)": lambda: torch.where(x > 0),
    "x[mask]": lambda: x[x > 0],
    "x[mask] = 0": lambda: x.clone().__setitem__(x > 0, 0.0),
    "masked_select": lambda: x.masked_select(x > 0),
    "unique": lambda: x.unique(),
    "bincount": lambda: torch.bincount((x > 0).long()),
    "repeat_interleave": lambda: torch.arange(2).repeat_interleave(torch.tensor([1, 2])),
    "one_hot, classes from the data": lambda: F.one_hot(torch.tensor([1])),
    "x[mask] in backward": lambda: x.clone().requires_grad_()[x > 0].sum().backward(),
}
QUEUES = {
    "x[indices]": lambda: x[torch.tensor([1, 3])],
    "where(mask, a, b)": lambda: torch.where(x > 0, x, 0.0),
    "repeat_interleave, output_size given": lambda: torch.arange(2).repeat_interleave(torch.tensor([1, 2]),
                                                                                      output_size=3),
    "one_hot, classes given": lambda: F.one_hot(torch.tensor([1]), 3),  # the CPU kernel's own check is not ours
    "nonzero_static": lambda: torch.nonzero_static(x, size=2),
    "matmul backward": lambda: (x.clone().requires_grad_() @ x).backward(),
}


@pytest.mark.parametrize("name", WAITS)
def test_host_reads_catches_what_waits_for_the_device(name):
    with pytest.raises(RuntimeError, match=r"on a cpu tensor of shape .* makes the host wait"), HostReads("cpu"):
        WAITS[name]()
    with HostReads("cpu") as watch, watch.paused():
        WAITS[name]()
    with HostReads("cuda"):  # CPU tensors are the host's: free to read when the device is a GPU
        WAITS[name]()


@pytest.mark.parametrize("name", QUEUES)
def test_host_reads_lets_work_that_only_queues_through(name):
    with HostReads("cpu"):
        QUEUES[name]()


def test_host_tensors_by_design_may_be_read():
    counter = torch.tensor(3.0)
    with HostReads("cpu", host=[counter]):
        assert counter.item() == 3.0
        with pytest.raises(RuntimeError, match="makes the host wait"):
            (counter + 1).item()
