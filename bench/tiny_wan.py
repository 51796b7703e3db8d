"""A tiny random Wan 2.1 text-to-video pipeline, saved as diffusers saves Wan-AI/Wan2.1-T2V-1.3B-Diffusers: the same
classes and folder layout (model_index.json; transformer/, vae/, text_encoder/, tokenizer/, scheduler/), at a size a
CPU samples in seconds. For the CPU run of README's "Fine-tuning Wan 2.1" chain and for the tests: nothing comes from
the hub.

- transformer/: a WanTransformer3DModel 64 wide (2 heads of 32), 2 blocks, FFN 128, 4 latent channels, text 32 wide
  (ditcore's Wan-Tiny preset has these sizes), every weight random;
- vae/: an AutoencoderKLWan of Wan 2.1's structure (8x spatial and 4x temporal compression: 1 + 4k frames), 8
  channels wide, with per-channel latents_mean and latents_std that are not 0 and 1, so that using them shows;
- text_encoder/ and tokenizer/: a 2-layer UMT5EncoderModel (32 wide) and a real (Unigram) T5 tokenizer;
- scheduler/: UniPCMultistepScheduler with flow sigmas (Wan 2.1 1.3B's), or FlowMatchEulerDiscreteScheduler.

    python bench/tiny_wan.py OUT [--scheduler unipc|euler] [--shift 3.0] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

WORDS = ["a", "an", "red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink", "white", "black",
         "butterfly", "with", "spots", "stripes", "flying", "left", "right", "over", "grass", "sky", "blurry"]
LATENT_CHANNELS, TEXT_DIM = 4, 32


def tokenizer():
    """A Unigram T5 tokenizer (UMT5's kind) over a few words, and letters for any other word."""
    import transformers

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz&;,."] + [("▁" + w, -1.0) for w in WORDS]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0)


def pipeline(scheduler: str = "unipc", shift: float = 3.0, seed: int = 0):
    """The WanPipeline (random weights from `seed`)."""
    import diffusers
    import transformers

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=128, num_layers=2,
        rope_max_seq_len=256).eval()
    with torch.no_grad():  # every weight off its initialisation (zeroed biases and unit norms would hide a layout)
        for p in transformer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    latents_mean = (torch.rand(LATENT_CHANNELS, generator=g) * 2 - 1).tolist()
    latents_std = (torch.rand(LATENT_CHANNELS, generator=g) * 2 + 0.5).tolist()
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=latents_mean,
                                     latents_std=latents_std).eval()
    config = transformers.UMT5Config(vocab_size=len(tokenizer()), d_model=TEXT_DIM, d_ff=64, d_kv=8, num_heads=4,
                                     num_layers=2)
    text_encoder = transformers.UMT5EncoderModel(config).eval()
    if scheduler == "unipc":  # Wan 2.1 1.3B's scheduler_config.json: flow sigmas, flow_shift 3
        sampler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                    flow_shift=shift)
    elif scheduler == "euler":
        sampler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    else:
        raise ValueError(f"scheduler={scheduler!r}: expected unipc or euler")
    return diffusers.WanPipeline(tokenizer=tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=sampler,
                                 transformer=transformer)


def write(out: str | Path, scheduler: str = "unipc", shift: float = 3.0, seed: int = 0) -> Path:
    """Save the pipeline to `out` (save_pretrained); returns it."""
    out = Path(out)
    pipeline(scheduler, shift, seed).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (a diffusers WanPipeline)")
    parser.add_argument("--scheduler", choices=("unipc", "euler"), default="unipc")
    parser.add_argument("--shift", type=float, default=3.0, help="the scheduler's flow shift (Wan 2.1 480p: 3)")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    args = parser.parse_args()
    print(f"wrote {write(args.out, args.scheduler, args.shift, args.seed)}: a tiny random WanPipeline "
          f"({args.scheduler}, shift {args.shift:g})")


if __name__ == "__main__":
    main()
