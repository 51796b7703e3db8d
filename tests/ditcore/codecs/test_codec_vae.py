"""DiffusersVAECodec on tiny randomly initialised VAEs, saved and loaded through the real local-folder path."""

import json

import huggingface_hub.constants
import pytest
import torch

from ditcore.codecs import DiffusersVAECodec, HubLoadError, load_codec
from ditcore.testing import assert_close_fp32

diffusers = pytest.importorskip("diffusers")


def pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def vae_dirs(tmp_path_factory):
    """Folders written by save_pretrained; AutoencoderKL under a subfolder, as in pipeline repositories."""
    root = tmp_path_factory.mktemp("vaes")
    torch.manual_seed(0)
    diffusers.AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=8,
    ).save_pretrained(root / "kl" / "vae")
    diffusers.AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8), num_encoder_blocks=(1, 1, 1),
        num_decoder_blocks=(1, 1, 1), latent_channels=4,
    ).save_pretrained(root / "tiny")
    diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    ).save_pretrained(root / "wan")
    return root


def encoder_work(vae: torch.nn.Module, pixels: int) -> int:
    """Float32 work of a latent value (see ditcore.testing), counted generously from the encoder's layers as if
    they all formed one chain: each convolution's and linear layer's fan-in, each norm's reduction (GroupNorm's
    over up to `pixels` positions of a frame) and each attention's q·k, softmax and weighted sums."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanRMS_norm

    work = 0
    for name, m in vae.named_modules():
        if name.startswith(("decoder", "post_quant_conv")):
            continue
        if isinstance(m, torch.nn.Conv2d | torch.nn.Conv3d | torch.nn.Linear):
            work += m.weight[0].numel()  # in_channels / groups × kernel
        elif isinstance(m, torch.nn.GroupNorm):
            work += m.num_channels // m.num_groups * pixels
        elif isinstance(m, WanRMS_norm):
            work += m.gamma.numel()  # over the channels
        elif isinstance(m, Attention | WanAttentionBlock):
            work += getattr(m, "inner_dim", None) or m.dim  # q·k over the channels (one head)
            work += 2 * pixels  # softmax and weighted sums over the frame's positions
    return work


def reload(codec, tmp_path):
    config = json.loads(json.dumps(codec.save(tmp_path)))
    assert config["kind"] == "diffusers" and not any(tmp_path.iterdir())  # the weights are referenced, not copied
    return load_codec(config, tmp_path)


def test_autoencoder_kl_encodes_each_frame_with_the_posterior_mean(vae_dirs, tmp_path):
    codec = DiffusersVAECodec(vae_dirs / "kl", "AutoencoderKL", subfolder="vae")
    assert (codec.latent_channels, codec.spatial_factor, codec.temporal_factor) == (4, 2, 1)
    x = pixels(2, 3, 3, 16, 24)
    z = codec.encode(x)
    assert z.shape == (2, 4, 3, 8, 12) and z.dtype == torch.float32
    # parity with calling diffusers directly on one frame
    expected = codec.vae.encode(x[:, :, 1]).latent_dist.mode()
    assert_close_fp32(z[:, :, 1], expected, work=encoder_work(codec.vae, pixels=16 * 24))
    assert torch.equal(codec.encode(x), z)  # the mode, not a sample: deterministic
    out = codec.decode(z)
    assert out.shape == x.shape and out.abs().max() <= 1
    loaded = reload(codec, tmp_path)
    assert torch.equal(loaded.encode(x), z) and torch.equal(loaded.decode(z), out)


def test_autoencoder_tiny(vae_dirs, tmp_path):
    codec = DiffusersVAECodec(vae_dirs / "tiny", "AutoencoderTiny")
    assert (codec.latent_channels, codec.spatial_factor, codec.temporal_factor) == (4, 4, 1)
    x = pixels(1, 3, 2, 16, 16)
    z = codec.encode(x)
    assert z.shape == (1, 4, 2, 4, 4)
    assert_close_fp32(z[:, :, 0], codec.vae.encode(x[:, :, 0]).latents, work=encoder_work(codec.vae, pixels=16 * 16))
    loaded = reload(codec, tmp_path)
    assert torch.equal(loaded.encode(x), z) and torch.equal(loaded.decode(z), codec.decode(z))


def test_wan_video_vae_is_causal_in_time(vae_dirs, tmp_path):
    codec = DiffusersVAECodec(vae_dirs / "wan", "AutoencoderKLWan")
    assert (codec.latent_channels, codec.spatial_factor, codec.temporal_factor) == (4, 2, 2)
    x = pixels(1, 3, 5, 16, 16)
    z = codec.encode(x)
    assert z.shape == (1, 4, 3, 8, 8) == (1, 4, *codec.latent_size(5, 16, 16))
    # causal: the first latent frame depends on the first pixel frame only
    assert_close_fp32(codec.encode(x[:, :, :1])[:, :, 0], z[:, :, 0], work=encoder_work(codec.vae, pixels=16 * 16))
    assert codec.decode(z).shape == x.shape
    loaded = reload(codec, tmp_path)
    assert torch.equal(loaded.encode(x), z)
    with pytest.raises(ValueError, match=r"got 4 frames: expected 1 \+ k·2 frames .* keep the first 3"):
        codec.encode(pixels(1, 3, 4, 16, 16))


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")  # diffusers 0.42 passes it
def test_hub_id_offline_is_one_clear_error(monkeypatch):
    # What an offline machine sees, without waiting for the HTTP retries of a missing network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubLoadError) as info:
        DiffusersVAECodec("stabilityai/sd-vae-ft-mse")
    message = str(info.value)
    assert message.startswith("could not load VAE 'stabilityai/sd-vae-ft-mse' from the Hugging Face hub (offline: "
                              "HF_HUB_OFFLINE is set; not in its local cache) — ")
    assert "pass a local folder" in message and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"VAE folder '\./no/such/vae' does not exist"):
        DiffusersVAECodec("./no/such/vae")
    with pytest.raises(ValueError, match="vae_class='VQModel' is not supported: expected one of AutoencoderKL"):
        DiffusersVAECodec(tmp_path, "VQModel")


class _Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a hostile pickle holds: a call, run by any unpickler that allows it
        import os

        return os.system, (f"touch {self.marker}",)


def test_pickled_weights_load_as_tensors_and_a_pickle_holding_code_is_refused_unrun(vae_dirs, tmp_path):
    """A folder whose weights are a .bin (diffusers' first saves) loads through torch's weights-only unpickler, to
    the same weights; one whose .bin holds a call is refused naming the file and the call, which never ran."""
    import pickle

    from ditcore.safe_state import UnsafeFileError

    codec = DiffusersVAECodec(vae_dirs / "kl", "AutoencoderKL", subfolder="vae")
    codec.vae.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert [p.name for p in (tmp_path / "bin").glob("*.bin")] == ["diffusion_pytorch_model.bin"]
    assert not any((tmp_path / "bin").glob("*.safetensors"))
    loaded = DiffusersVAECodec(tmp_path / "bin", "AutoencoderKL").vae.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in codec.vae.state_dict().items())
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "config.json").write_bytes((tmp_path / "bin" / "config.json").read_bytes())
    (tmp_path / "evil" / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(_Planted(tmp_path / "ran")))
    with pytest.raises(UnsafeFileError, match=r"VAE weights '.*evil/diffusion_pytorch_model.bin' does not load as "
                                              r"tensors \(.*(GLOBAL posix.system|Unsupported operand).*safetensors"):
        DiffusersVAECodec(tmp_path / "evil", "AutoencoderKL")
    assert not (tmp_path / "ran").exists()
