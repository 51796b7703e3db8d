"""The Gradio app: prompt → sampled video and first frame, with the run's validation samples alongside.

Given a run directory, a picker offers its export and every complete training checkpoint (whose EMA
shards are consolidated on load, so a TP>1 run samples on one device). Bad requests show a message in the
page; the server keeps serving.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import gradio as gr
import torch

from dit_sample.generate import LIMITS, RequestError, Sampler, resolve_checkpoint
from ditcore.export import load_export
from ditcore.media import write_sample
from ditcore.parallel.tensor_parallel import consolidate_shard_files

EXPORT = "export (final EMA weights)"


def checkpoint_choices(path: Path) -> dict[str, Path]:
    """Label → folder: the export, then training checkpoints newest first (run directories only)."""
    choices = {EXPORT: resolve_checkpoint(path)}
    ckpts = Path(path) / "checkpoints"
    if ckpts.is_dir():
        for d in sorted(ckpts.glob("step-*"), reverse=True):
            if (d / "COMPLETE").is_file():
                choices[d.name] = d
    return choices


def load_sampler(base: Sampler, folder: Path) -> Sampler:
    """The base (export) sampler with the EMA weights of a training checkpoint folder swapped in."""
    if (folder / "model.safetensors").is_file():
        return base
    state = consolidate_shard_files(sorted(folder.glob("model_parallel_rank_*.pt")), key="ema")
    exported = load_export(base.path)
    exported.model.load_state_dict(state)
    return Sampler(exported, base.text, base.path)


def build_app(checkpoint: str | Path, concurrency: int = 1) -> gr.Blocks:
    checkpoint = Path(checkpoint)
    choices = checkpoint_choices(checkpoint)
    base = Sampler.load(choices[EXPORT])
    loaded = {EXPORT: base}
    cfg = base.exported.model.cfg
    sizes = base.sizes()
    default_size = 64 if 64 in sizes else sizes[0]
    samples_dir = checkpoint / "samples"
    gallery = sorted(samples_dir.glob("*/*.png"))[-24:] if samples_dir.is_dir() else []

    def run(choice, prompt, negative, class_label, steps, guidance, seed, frames, size, solver,
            progress=gr.Progress()):
        try:
            if choice not in loaded:
                loaded[choice] = load_sampler(base, choices[choice])
            sampler = loaded[choice]
            kwargs = dict(steps=int(steps), guidance=float(guidance), seed=int(seed), frames=int(frames),
                          height=int(size), width=int(size), solver=solver)
            if sampler.class_conditional:
                kwargs["class_labels"] = [int(class_label)]
            else:
                kwargs |= {"prompts": [prompt or ""], "negative_prompt": negative or None}
            progress(0, desc="sampling")
            result, seconds = sampler.run(callback=lambda i, n: progress((i + 1) / n, desc=f"step {i + 1}/{n}"),
                                          **kwargs)
        except RequestError as e:
            raise gr.Error(str(e)) from None
        out = Path(tempfile.mkdtemp(prefix="dit-sample-"))
        pixels = result.pixels[0].numpy()
        # always an mp4 for the player (a single frame plays as a still), and the first frame as an image
        video = write_sample(pixels if pixels.shape[0] > 1 else pixels.repeat(2, 0), out / "sample.mp4")
        info = f"NFE {result.nfe} · {seconds:.2f} s · seed {int(seed)} · {int(frames)}×{int(size)}×{int(size)}"
        return str(video), pixels[0], info

    with gr.Blocks(title="ditcore sampler") as demo:
        conditioning = "class-conditional" if base.class_conditional else \
            f"text: {base.exported.info.text_encoder['name']}"
        gr.Markdown(f"## ditcore sampler\n`{checkpoint}` · {cfg.depth} layers × {cfg.hidden_size} · {conditioning}")
        with gr.Row():
            with gr.Column():
                choice = gr.Dropdown(list(choices), value=EXPORT, label="checkpoint", elem_id="checkpoint",
                                     visible=len(choices) > 1)
                prompt = gr.Textbox(label="prompt", value="a red butterfly", elem_id="prompt",
                                    visible=not base.class_conditional)
                negative = gr.Textbox(label="negative prompt", elem_id="negative", visible=not base.class_conditional)
                class_label = gr.Dropdown(list(range(max(1, cfg.num_classes))), value=0, label="class", elem_id="class",
                                          visible=base.class_conditional)
                steps = gr.Slider(*LIMITS["steps"], value=18, step=1, label="steps", elem_id="steps")
                guidance = gr.Slider(*LIMITS["guidance"], value=4.0, step=0.1, label="guidance", elem_id="guidance")
                with gr.Row():
                    seed = gr.Number(value=0, precision=0, label="seed", elem_id="seed")
                    shuffle = gr.Button("random seed", elem_id="random-seed")
                frames = gr.Slider(1, 32, value=8, step=1, label="frames", elem_id="frames")
                size = gr.Dropdown(sizes, value=default_size, label="resolution (pixels, square)", elem_id="size")
                solver = gr.Radio(["heun", "euler"], value="heun", label="solver", elem_id="solver")
                go = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column():
                video = gr.Video(label="sample", elem_id="vid", autoplay=True, loop=True)
                first = gr.Image(label="first frame", elem_id="first-frame", type="numpy")
                info = gr.Markdown(elem_id="info")
        if gallery:
            gr.Gallery([str(p) for p in gallery], label="validation samples from training", columns=8,
                       elem_id="gallery")
        shuffle.click(lambda: random.randint(0, 2**31 - 1), outputs=seed)
        go.click(run, [choice, prompt, negative, class_label, steps, guidance, seed, frames, size, solver],
                 [video, first, info], concurrency_limit=concurrency, api_name="generate")
    demo.queue(default_concurrency_limit=concurrency)
    torch.set_grad_enabled(False)
    return demo
