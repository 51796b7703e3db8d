"""The `dit-sample` command line: `generate` writes files, `serve` runs the Gradio app."""

from __future__ import annotations

import enum
import os
import shlex
import time
from pathlib import Path

import typer

from ditcore.choices import FEATURES, SAMPLE_SOLVERS
from ditcore.cli import entry_point, fail, new_app, stop_on_signal, version_option

app = new_app(
    "dit-sample",
    help="Sample a trained DiT checkpoint and decode latents to images and video (Gradio UI and CLI).",
    no_args_is_help=True,
)


# Typer lists and validates these choices, read from the library's lists of them (ditcore.choices: no torch import)
Solver = enum.StrEnum("Solver", {name: name for name in SAMPLE_SOLVERS})
Features = enum.StrEnum("Features", {name: name for name in FEATURES})


class Schedule(enum.StrEnum):  # ditcore.sampling.SCHEDULES (a module that imports torch; tests/apps/test_choices.py)
    karras = "karras"
    ddim = "ddim"


class Format(enum.StrEnum):
    diffusers = "diffusers"


CHECKPOINT_HELP = ("An export folder (RUN_DIR/export), a training checkpoint (RUN_DIR/checkpoints/step-N: its EMA "
                   "weights), a run directory (its export, else its newest complete checkpoint), or one of the "
                   "field's checkpoints: an "
                   "original DiT file (DiT-XL-2-256x256.pt, .safetensors), a diffusers DiTTransformer2DModel folder or "
                   "DiT pipeline folder (transformer/, scheduler/, vae/), a WanTransformer3DModel folder or "
                   "WanPipeline folder (Wan 2.1 text-to-video: transformer/, vae/, text_encoder/, tokenizer/, "
                   "scheduler/).")
VAE_HELP = ("The field's checkpoints only: the VAE that decodes its latents, a local folder (save_pretrained) or hub "
            "id. Default: a pipeline's own vae/, else stabilityai/sd-vae-ft-ema (DiT's); a bare "
            "WanTransformer3DModel folder needs one (an AutoencoderKLWan).")
TEXT_ENCODER_HELP = ("The field's text-conditioned checkpoints only: the text encoder, by ditcore's name (umt5:<hub id "
                     "or folder>, e.g. umt5:google/umt5-xxl). Default: a WanPipeline folder's own (its text_encoder/ "
                     "and tokenizer/); a bare WanTransformer3DModel folder needs one.")
HEADS_HELP = ("The field's checkpoints only: attention heads of an original DiT file whose width is none of the "
              "paper's (S/B/L/XL: its state dict does not record them).")


def output_problem(out: Path) -> str | None:
    """Why `out` cannot be written (checked before the model loads), or None."""
    folder = out.parent
    if out.is_dir():
        return f"--out '{out}' is a directory: give a file name, e.g. {out / 'sample.png'}"
    if not folder.is_dir():
        return f"--out '{out}': the folder '{folder}' does not exist — create it first or choose another path"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"--out '{out}': the folder '{folder}' is not writable — choose another path"
    return None


@app.callback()
def main(version_: bool = version_option("dit-sample")) -> None:
    """Sample a trained DiT checkpoint and decode latents to images and video (Gradio UI and CLI)."""


@app.command()
def generate(
    checkpoint: Path = typer.Option(..., help=CHECKPOINT_HELP),
    prompt: list[str] = typer.Option(None, help="What to draw; repeat for several samples in one batch."),
    negative_prompt: str = typer.Option(None, help="Steer away from this (the unconditional side of CFG)."),
    class_label: list[int] = typer.Option(None, "--class", help="Class-conditional models: class index; repeat."),
    steps: int = typer.Option(18, help="Sampler steps (Heun: 2·steps − 1 denoiser evaluations)."),
    guidance: float = typer.Option(None, help="Classifier-free guidance weight w (1: no guidance). Default: the "
                                              "weight the run validated with (4.0 for older exports).",
                                   show_default=False),
    seed: int = typer.Option(0, help="Random seed: the same seed gives the same output."),
    frames: int = typer.Option(1, help="Frames (1: an image → png; more: a clip → mp4)."),
    height: int = typer.Option(None, help="Height in pixels. Default: the height (and width) the run trained at most; "
                                          "else the size it validated at; else 64.", show_default=False),
    width: int = typer.Option(None, help="Width in pixels. Default: see --height.", show_default=False),
    solver: Solver = typer.Option(None, help="heun (2nd order) or euler; unipc for flow-matching networks "
                                             "(diffusers' UniPC multistep scheduler, as Wan samples). A flow network "
                                             "samples with the timestep shift it was trained with. Default: the solver "
                                             "the run validated with; an imported pipeline's scheduler's (Wan 2.1: "
                                             "unipc); else heun.", show_default=False),
    schedule: Schedule = typer.Option("karras", help="Noise levels: karras (EDM's, rho 7) or ddim (a DDPM network's "
                                                     "own timesteps, spaced as DDIM spaces them; with --solver euler "
                                                     "this is DDIM). ddim: VP-preconditioned networks only. A flow "
                                                     "network steps through its shifted times t whatever this says."),
    vae: str = typer.Option(None, help=VAE_HELP, show_default=False),
    num_heads: int = typer.Option(None, min=1, help=HEADS_HELP, show_default=False),
    text_encoder: str = typer.Option(None, help=TEXT_ENCODER_HELP, show_default=False),
    fps: float = typer.Option(8.0, min=0.1, max=240.0,
                              help="Frame rate of the mp4 (and the model's fps condition, if it has one)."),
    out: Path = typer.Option(Path("sample.png"), help="Output file; several prompts add -0, -1, … to the name."),
) -> None:
    """Sample prompts and write an mp4 (frames > 1) or png (frames = 1) for each."""
    from dit_sample.generate import RequestError, Sampler
    from ditcore import runs, stopping
    from ditcore.codecs import HubLoadError
    from ditcore.disk import DiskFull
    from ditcore.media import write_sample
    from ditcore.sampling import step_bar

    problem = output_problem(out)
    if problem:
        fail(problem)
    with stop_on_signal():  # loading, each sampling step and the writing: Ctrl-C or SIGTERM stop it
        try:
            sampler = Sampler.load(checkpoint, vae, num_heads, text_encoder)
            if sampler.chosen(checkpoint):
                typer.echo(sampler.chosen(checkpoint))
            if "imported" in sampler.exported.extra:
                typer.echo(f"sampling {sampler.exported.extra['imported']}")
            if not sampler.class_conditional and not prompt:
                example = f", e.g. --prompt {shlex.quote(sampler.prompts()[0])}" if sampler.prompts() else ""
                raise RequestError(f"--prompt is required: describe what to draw{example}")
            guidance = sampler.exported.guidance if guidance is None else guidance
            solver = sampler.exported.solver if solver is None else solver
            trained_height, trained_width = sampler.default_size()
            height = trained_height if height is None else height
            width = trained_width if width is None else width
            request = dict(prompts=prompt, negative_prompt=negative_prompt, class_labels=class_label, steps=steps,
                           guidance=guidance, seed=seed, frames=frames, height=height, width=width, solver=str(solver),
                           schedule=str(schedule))
            sampler.check(**request)  # a bad request is refused before the text encoder loads (seconds)
            sampler.load_text()  # before the bar starts: the bar counts sampling steps only
            with step_bar(steps, "sampling") as bar:  # a signal stops it at the next step: nothing is written
                result, seconds = sampler.run(**request, fps=fps, callback=stopping.checked(bar))
        except (RequestError, FileNotFoundError, ValueError, KeyError, HubLoadError, runs.CheckpointError) as e:
            fail(str(e))
        except stopping.Stopped as e:
            e.add_note(f"no sample was written to {out}")
            raise
        n = result.pixels.shape[0]
        for i, pixels in enumerate(result.pixels):
            target = out if n == 1 else out.with_name(f"{out.stem}-{i}{out.suffix}")
            try:
                written = write_sample(pixels.numpy(), target, fps=fps)
            except DiskFull as e:  # names the file and the space free
                fail(str(e))
            except (OSError, RuntimeError) as e:  # e.g. the disk filled up, or ffmpeg could not write there
                fail(f"could not write {target}: {e}")
            typer.echo(f"wrote {written}")
        typer.echo(f"{n} sample(s) of {frames}x{height}x{width}: {result.nfe} denoiser evaluations "
                   f"({'2x' if guidance != 1 else '1x'} batch for guidance), seed {seed}: generated in "
                   f"{seconds:.2f} s, {sampler.loaded()}")


@app.command("eval")
def evaluate(
    checkpoint: Path = typer.Option(..., help="A run directory (its export, else its newest complete checkpoint), its "
                                              "export folder, or one of its training checkpoints "
                                              "(RUN_DIR/checkpoints/step-N: its EMA weights)."),
    reference: Path = typer.Option(..., help="The real images: a ditcore dataset folder (its statistics are "
                                             "computed once and cached in DATA/eval/), a statistics .safetensors "
                                             "from there, or an ADM-style .npz with mu and sigma (Inception)."),
    num: int = typer.Option(..., help="Samples to score, over all ranks (FID-50K: 50000); at least 2."),
    features: Features = typer.Option("inception", help="inception: FID as papers report it (needs "
                                                        "torch-fidelity, ditcore's fid extra: .venv/bin/pip install -c "
                                                        "constraints.txt -e 'packages/ditcore[fid]'); dinov2: "
                                                        "FD_DINOv2."),
    weights: str = typer.Option(None, help="inception: a local copy of torch-fidelity's pt_inception-2015-12-05 "
                                           "weights; dinov2: a hub id or save_pretrained folder (default "
                                           "facebook/dinov2-large).", show_default=False),
    steps: int = typer.Option(18, min=1, max=500, help="Sampler steps (Heun: 2·steps − 1 denoiser evaluations)."),
    guidance: float = typer.Option(None, help="Classifier-free guidance weight (1: none). Default: the weight the "
                                              "run validated with.", show_default=False),
    seed: int = typer.Option(0, min=0, help="Batch b samples with seed + b; classes are drawn with the seed."),
    batch: int = typer.Option(16, min=1, help="Samples per sampler call on each rank."),
    height: int = typer.Option(None, help="Pixels; default and required: the reference's image size (an .npz "
                                          "records none: then the run's).", show_default=False),
    width: int = typer.Option(None, help="Pixels; see --height.", show_default=False),
) -> None:
    """Score N samples of a run's EMA weights with FID (or FD_DINOv2) against a reference; writes RUN/eval/*.json.

    Under torchrun the N samples are split over the ranks: torchrun --nproc-per-node G -- $(which dit-sample) eval
    ... (the `--` keeps torchrun from reading --num as its own --numa-binding)."""
    from dit_sample.evaluate import evaluate as run_eval
    from dit_sample.generate import RequestError
    from ditcore import runs
    from ditcore.codecs import HubLoadError
    from ditcore.data.schema import DatasetError
    from ditcore.eval import FeatureError, ReferenceError

    with stop_on_signal():  # at the next sampler step (dit_sample.evaluate): no score is written
        try:
            result, written = run_eval(checkpoint, reference, num, features=str(features), weights=weights,
                                       steps=steps, guidance=guidance, seed=seed, batch=batch, height=height,
                                       width=width, say=typer.echo)
        except (RequestError, ReferenceError, FeatureError, DatasetError, FileNotFoundError, HubLoadError,
                runs.CheckpointError) as e:
            fail(str(e))
    if written is not None:
        typer.echo(f"{result['what']} {result['value']:.4f} of {num} samples (step {result['step']}, "
                   f"{result['height']}x{result['width']}, {steps} steps, guidance {result['guidance']}, seed {seed}) "
                   f"against {reference} ({result['reference_n']} images, {result['features']}): wrote {written}")


@app.command()
def serve(
    checkpoint: Path = typer.Option(..., help="An export folder, a run directory (pick among its export and "
                                              "checkpoints), a training checkpoint, or one of the field's DiT "
                                              "checkpoints (see generate --help)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 127.0.0.1 keeps it on this machine."),
    port: int = typer.Option(7860, min=1, max=65535, help="Port to listen on; it must be free."),
    concurrency: int = typer.Option(1, min=1, help="Requests sampled at the same time; the rest wait in a queue."),
    queue_size: int = typer.Option(64, min=1, help="Requests that may wait in the queue; more are refused with "
                                                   "'queue is full' until one finishes."),
    max_token_steps: int = typer.Option(2**18, min=1, help="Largest request: latent tokens (frames x pixels) x "
                                                          "sampler steps; larger ones are refused with a message."),
    vae: str = typer.Option(None, help=VAE_HELP, show_default=False),
    num_heads: int = typer.Option(None, min=1, help=HEADS_HELP, show_default=False),
    text_encoder: str = typer.Option(None, help=TEXT_ENCODER_HELP, show_default=False),
) -> None:
    """Run the Gradio app: prompt → video/image in the browser. Never opens a public share link."""
    from dit_sample.app import build_app, exposure_warning, launch_options, port_problem
    from ditcore import runs, stopping
    from ditcore.codecs import HubLoadError

    problem = port_problem(host, port)  # before the model loads: a taken port should fail in seconds
    if problem:
        fail(problem)
    warning = exposure_warning(host)
    if warning:
        typer.echo(warning, err=True)
    # Ctrl-C, and the SIGTERM of `docker stop`, systemd and `kill`, are recorded (by default SIGTERM would end Python
    # without its exit handlers): the server then closes and the app's temporary folder of request outputs goes
    with stopping.Signals() as signals:
        try:
            demo = build_app(checkpoint, concurrency=concurrency, queue_size=queue_size,
                             max_token_steps=max_token_steps, vae=vae, num_heads=num_heads,
                             text_encoder=text_encoder)
        except (FileNotFoundError, ValueError, KeyError, HubLoadError, runs.CheckpointError) as e:
            fail(str(e))
        typer.echo(f"serving {checkpoint} on http://{host}:{port}")
        try:
            demo.launch(server_name=host, server_port=port, share=False, quiet=True, prevent_thread_lock=True,
                        **launch_options())
        except OSError as e:  # the port was taken between the check and the launch
            fail(f"cannot serve on {host}:{port}: {e} — pass a free port with --port")
        while not signals.received and demo.is_running:
            time.sleep(stopping.POLL_S)
        demo.close()
    if signals.received:
        typer.echo(f"stopped serving ({stopping.name(signals.received[0])})")


@app.command()
def export(
    out: Path = typer.Argument(..., metavar="OUT", help="The folder to write: a diffusers DiTTransformer2DModel, "
                                                        "or WanTransformer3DModel for a Wan (config.json, "
                                                        "diffusion_pytorch_model.safetensors, and ditcore.json: how "
                                                        "it is preconditioned or what it was trained with)."),
    checkpoint: Path = typer.Option(..., help=CHECKPOINT_HELP),
    format_: Format = typer.Option(..., "--format", help="diffusers: a DiTTransformer2DModel or WanTransformer3DModel "
                                                        "folder, by the model's architecture (the one format so "
                                                        "far)."),
    approximate: bool = typer.Option(False, help="Export a DDPM-trained network with the original DiT's timestep "
                                                 "sinusoid anyway (an original DiT checkpoint, or a run fine-tuned "
                                                 "from one): diffusers computes its own, 10000^(-k/(half-1)), as its "
                                                 "conversion of DiT-XL/2 does — close to the network's function, not "
                                                 "equal. Refused for EDM and flow networks (their output moves far "
                                                 "beyond float error); train with --config dit-xl-diffusers for an "
                                                 "exact export."),
    num_heads: int = typer.Option(None, min=1, help=HEADS_HELP, show_default=False),
    force: bool = typer.Option(False, help="Replace OUT if it exists (it is replaced whole, once the new folder is "
                                           "complete)."),
) -> None:
    """Write the model to another library's format: a folder `DiTTransformer2DModel.from_pretrained(OUT)` (a DiT) or
    `WanTransformer3DModel.from_pretrained(OUT)` (a Wan, model.arch=wan) loads.

    Refused, naming the first feature the format cannot hold (RoPE, QK-norm, text conditioning, video, ...)."""
    from dit_sample.export import to_diffusers
    from ditcore.disk import DiskFull

    try:
        lines = to_diffusers(checkpoint, out, approximate=approximate, num_heads=num_heads, force=force)
    except (FileNotFoundError, ValueError, KeyError, DiskFull) as e:  # ExportError and ConversionError: ValueErrors
        fail(str(e))
    for line in lines:
        typer.echo(line)


run = entry_point(app)  # the console script: usage errors are one line, exit code 2
