"""The Gradio app: prompt → sampled video and first frame, with the run's validation samples alongside.

Given a run directory, a picker offers its export (if it has one yet) and every complete training checkpoint (whose
EMA shards are consolidated on load, so a TP>1 run samples on one device). Every request, from the page or the
API, is checked before anything large is allocated; a bad one gets a message naming the value and what is
allowed, and the server keeps serving. Memory, time and disk stay bounded: a few checkpoints loaded, a bounded
queue, requests of at most `max_token_steps` (tokens × steps), a cancelled request stopped at its next step, the
newest few outputs kept.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import errno
import ipaddress
import itertools
import math
import random
import shutil
import socket
import sys
import tempfile
import threading
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gradio as gr
import torch

from dit_sample.generate import LIMITS, SOLVERS, RequestError, Sampler, load_checkpoint
from ditcore import interop, runs
from ditcore.disk import DiskFull
from ditcore.media import write_sample
from ditcore.sampling import token_grid

EXPORT = "export (final EMA weights)"
KEEP_CHECKPOINTS = 2  # training checkpoints kept loaded besides the export: each one is a full copy of the model
KEEP_OUTPUTS = 8  # newest request outputs kept on disk (Gradio serves its own copies, see CACHE_CLEANUP)
CACHE_CLEANUP = (600, 3600)  # Gradio's delete_cache: every 10 min, delete its copies of outputs older than 1 h
MAX_FRAMES = 32  # the frames slider; longer clips are for `dit-sample generate`
# Work per request, in latent tokens × sampler steps (time grows with both, memory with the tokens): 2^18 is e.g.
# 32 frames of 16×16 tokens at 32 steps, or 512 tokens at 500 steps. `dit-sample serve --max-token-steps`.
MAX_TOKEN_STEPS = 2**18


class Cancelled(Exception):
    """Raised in the sampling thread at its next step once the request's caller has cancelled it (or left)."""


def checkpoint_choices(path: Path) -> dict[str, Path]:
    """Label → folder, the default first: a run directory's export, then its training checkpoints newest first (a
    run without an export yet: its newest checkpoint first, the one written last); an export folder or a training
    checkpoint alone; one of the field's DiT checkpoints (ditcore.interop) alone, in the export's place."""
    if interop.is_foreign(path):
        return {EXPORT: path}
    found = runs.find_sampleable(path)
    choices = {found.name: found} if runs.is_complete(found) else {EXPORT: found}
    if not runs.is_complete(path):  # a run directory (an export folder has no checkpoints)
        for d in reversed(runs.complete_checkpoints(path)):
            choices.setdefault(d.name, d)
    return choices


def run_dir_of(path: Path) -> Path:
    """The run directory of a training checkpoint; else `path` itself."""
    return path.parent.parent if runs.is_complete(path) else path


def contact_sheet_of(run_dir: Path) -> Path | None:
    """The run's newest contact sheet (samples/grid.png: validation prompts × seeds), or None."""
    sheet = run_dir / runs.SAMPLES / runs.SHEET
    return sheet if sheet.is_file() else None


def validation_gallery(run_dir: Path, newest: int = 24) -> list[Path]:
    """The newest validation images of the run's steps (not their contact sheets)."""
    folder = run_dir / runs.SAMPLES
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.glob("*/*.png")) if p.name != runs.SHEET][-newest:]


def load_sampler(base: Sampler, folder: Path) -> Sampler:
    """A training checkpoint's EMA weights (generate.load_checkpoint), sampled with the base's text encoder (one
    copy of its model)."""
    return Sampler(load_checkpoint(folder, picked=True), base.text, folder)


class Checkpoints:
    """The checkpoints offered in the picker, by label, loaded on first use.

    Only labels offered at start-up load: a request names a label, never a path. The default (the export, else the
    newest checkpoint) stays loaded; of the other checkpoints the `keep` most recently used do, so clicking through a
    long run does not grow memory.
    """

    def __init__(self, path: Path, keep: int = KEEP_CHECKPOINTS, vae: str | None = None,
                 num_heads: int | None = None, text_encoder: str | None = None):
        self.folders = checkpoint_choices(path)
        self.default = next(iter(self.folders))
        # the last three: the field's checkpoints only
        self.base = Sampler.load(self.folders[self.default], vae, num_heads, text_encoder)
        self.keep = keep
        self.loaded: OrderedDict[str, Sampler] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # concurrent requests must not load the same checkpoint twice

    def check(self, label) -> None:
        if not isinstance(label, str) or label not in self.folders:
            raise RequestError(f"checkpoint {label!r} is not one of those offered: {', '.join(self.folders)} — "
                               "pick one of these (a checkpoint saved after the app started needs a restart)")

    def get(self, label: str) -> Sampler:
        self.check(label)
        if label == self.default:
            return self.base
        with self._lock:
            if label in self.loaded:
                self.loaded.move_to_end(label)
                return self.loaded[label]
            folder = self.folders[label]
            if not runs.is_complete(folder):  # e.g. deleted by the run's checkpoint rotation since start-up
                raise RequestError(f"checkpoint {label} is no longer on disk ({folder}) — pick another one")
            while len(self.loaded) >= self.keep:  # evict first, so at most `keep` copies exist even while loading
                self.loaded.popitem(last=False)
            try:
                self.loaded[label] = load_sampler(self.base, folder)
            except (runs.CheckpointError, RequestError) as e:  # damaged since start-up, diverged, of another model:
                raise RequestError(str(e)) from None  # it says what to pick
            except (OSError, ValueError) as e:  # deleted meanwhile; weights that do not fit their model.json
                raise RequestError(f"{e} — pick another checkpoint") from None
            return self.loaded[label]


class Outputs:
    """One folder per request inside one app-owned temporary folder; only the newest `keep` are kept.

    A request's file must outlive the handler only until Gradio has copied it into its cache, right after the
    handler returns, so `keep` must exceed the number of requests in flight.
    """

    def __init__(self, keep: int):
        self.root = Path(tempfile.mkdtemp(prefix="dit-sample-"))
        atexit.register(shutil.rmtree, self.root, ignore_errors=True)
        self.keep = keep
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def new(self) -> Path:
        with self._lock:
            folder = self.root / f"{next(self._numbers):09d}"
            folder.mkdir()
            for old in sorted(self.root.iterdir())[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return folder


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (checked before the model loads), or None."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"port {port} on {host} is already in use (another dit-sample serve?) — stop that server "
                        f"or pass a free port, e.g. --port {port + 1}")
            return f"cannot listen on {host}:{port}: {e.strerror or e} — check --host and --port"
    return None


def exposure_warning(host: str) -> str | None:
    """A warning when `host` is reachable from other machines (any address but loopback), else None."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None  # port_problem has already said it cannot listen there
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return None
    return (f"warning: --host {host} serves the app to every machine that can reach this one: it has no login, so "
            "anyone who finds the port can sample on this machine's GPU/CPU — to use it from elsewhere, keep the "
            "default 127.0.0.1 and forward the port (ssh -L PORT:127.0.0.1:PORT HOST)")


class NoUploads:
    """ASGI middleware refusing Gradio's upload routes: the app has no file input, yet Gradio accepts anonymous
    uploads of any size there, keeps them on disk and serves them back to anyone with the link."""

    ROUTES = ("/upload", "/process_recording")  # under /gradio_api/ (and bare, in Gradio's static workers)

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/").endswith(self.ROUTES):
            from starlette.responses import PlainTextResponse

            refusal = PlainTextResponse("this app takes no file uploads", status_code=403)
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


def launch_options() -> dict:
    """What serve passes to Blocks.launch besides host and port: uploads closed (and bounded to 0 bytes, for the
    routes that read multipart bodies into memory and for Gradio's static workers, which the middleware misses)."""
    from starlette.middleware import Middleware

    return {"max_file_size": 0, "app_kwargs": {"middleware": [Middleware(NoUploads)]}}


def _whole(value):
    """JSON has one number type: 4.0 from an API caller means 4. Anything else is left for the checks to name."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def build_app(checkpoint: str | Path, concurrency: int = 1, queue_size: int = 64,
              max_token_steps: int = MAX_TOKEN_STEPS, vae: str | None = None, num_heads: int | None = None,
              text_encoder: str | None = None) -> gr.Blocks:
    """vae, num_heads, text_encoder: for one of the field's checkpoints (Sampler.load)."""
    checkpoint = Path(checkpoint)
    models = Checkpoints(checkpoint, vae=vae, num_heads=num_heads, text_encoder=text_encoder)
    base = models.base
    base.load_text()  # at start, not in the first request
    cfg = base.exported.model.cfg
    heights, widths = base.sides()
    height0, width0 = base.default_size()
    outputs = Outputs(keep=KEEP_OUTPUTS + concurrency)
    # Sampling runs on the app's own `concurrency` threads, not on whichever of Gradio's worker threads is free:
    # each new thread that runs torch gets its own OpenMP thread team and malloc arena, so memory crept up with
    # the number of threads that had ever sampled (measured: +115 MiB after 60 requests, and still rising).
    # Grad mode is per thread, so it is switched off in each of them.
    sampling = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dit-sample",
                                  initializer=torch.set_grad_enabled, initargs=(False,))
    sheet, gallery = contact_sheet_of(run_dir_of(checkpoint)), validation_gallery(run_dir_of(checkpoint))

    def check(choice, prompt, negative, class_label, steps, guidance, seed, frames, height, width, solver) -> dict:
        """The request's sampler arguments; RequestError naming the first bad value. Nothing is allocated."""
        models.check(choice)
        steps, seed, frames, height, width, class_label = map(_whole, (steps, seed, frames, height, width,
                                                                       class_label))
        for name, value, offered in (("height", height, heights), ("width", width, widths)):
            if isinstance(value, bool) or value not in offered:
                raise RequestError(f"{name}={value!r} is not offered: choose one of {', '.join(map(str, offered))} "
                                   "(pixels)")
        kwargs = dict(steps=steps, guidance=guidance, seed=seed, frames=frames, height=height, width=width,
                      solver=solver)
        if base.class_conditional:
            kwargs["class_labels"] = [class_label]
        else:
            kwargs |= {"prompts": [prompt], "negative_prompt": negative or None}
        base.check(**kwargs)  # every checkpoint of a run has the export's architecture
        if frames > MAX_FRAMES:
            raise RequestError(f"frames={frames} is more than this app offers: expected 1..{MAX_FRAMES} "
                               "(longer clips: dit-sample generate --frames)")
        tokens = math.prod(token_grid(base.exported.model, base.exported.codec, frames, height, width))
        if tokens * steps > max_token_steps:
            raise RequestError(f"{frames} frames of {height}x{width} pixels at {steps} steps is {tokens} tokens x "
                               f"{steps} steps = {tokens * steps} token-steps, more than this server's "
                               f"{max_token_steps} (dit-sample serve --max-token-steps) — ask for fewer frames, a "
                               "smaller size or fewer steps")
        return kwargs

    async def run(choice, prompt, negative, class_label, steps, guidance, seed, frames, height, width, solver,
                  progress=gr.Progress()):
        # The event has preprocess=False: values arrive as the caller sent them (API callers can send anything), and
        # are all checked here, with messages that name the field, before a checkpoint loads or sampling starts.
        # The handler is a coroutine so that a caller's cancel (or a closed page) reaches it: Gradio cancels its
        # task, which stops the sampling thread at its next step instead of letting it run on beside the next request.
        cancelled = threading.Event()

        def step(i: int, n: int) -> None:
            if cancelled.is_set():
                raise Cancelled()
            progress((i + 1) / n, desc=f"step {i + 1}/{n}")

        def work(kwargs: dict):
            sampler = models.get(choice)  # may load a checkpoint: in the sampling thread, not the server's loop
            progress(0, desc="sampling")
            result, seconds = sampler.run(**kwargs, callback=step)
            pixels = result.pixels[0].numpy()
            # always an mp4 for the player (a single frame plays as a still), and the first frame as an image
            try:
                video = write_sample(pixels if pixels.shape[0] > 1 else pixels.repeat(2, 0),
                                     outputs.new() / "sample.mp4")
            except DiskFull as e:  # the operator reads the folder and free space; the caller, that it was not them
                print(f"error: {e}", file=sys.stderr)
                raise gr.Error("the server's disk is full, so the sample could not be written — try again later",
                               print_exception=False) from None
            info = (f"NFE {result.nfe} · {seconds:.2f} s · seed {kwargs['seed']} · "
                    f"{kwargs['frames']}×{kwargs['height']}×{kwargs['width']}")
            return str(video), pixels[0], info

        try:
            kwargs = check(choice, prompt, negative, class_label, steps, guidance, seed, frames, height, width, solver)
            in_context = contextvars.copy_context().run  # progress() finds its request through context variables
            return await asyncio.wrap_future(sampling.submit(in_context, work, kwargs))
        except asyncio.CancelledError:
            cancelled.set()  # a queued job is dropped; a running one stops at its next step
            raise
        except RequestError as e:
            raise gr.Error(str(e), print_exception=False) from None  # the caller's mistake, not a server fault

    async def show(*values, progress=gr.Progress()):
        """The page's Generate: a refused or failed request says why in a warning and leaves the last good result
        (video, first frame, stats line) in place; raised to the page, the error would cover all three with "Error"
        badges. API callers get the error itself (the "generate" endpoint runs `run`)."""
        try:
            return await run(*values, progress=progress)
        except gr.Error as e:
            gr.Warning(e.message)
        except Exception as e:  # a server fault: the traceback for the operator, one line for the page
            traceback.print_exc()
            gr.Warning(f"sampling failed: {type(e).__name__}: {e}")
        return gr.skip(), gr.skip(), gr.skip()

    prompts, classes, trained = base.prompts(), base.example_classes(), base.trained_sizes()
    stride = base.exported.codec.spatial_factor * cfg.patch_size  # sizes are multiples of it
    with gr.Blocks(title="ditcore sampler", delete_cache=CACHE_CLEANUP) as demo:
        conditioning = "class-conditional" if base.class_conditional else \
            f"text: {base.exported.info.text_encoder['name']}"
        imported = base.exported.extra.get("imported")  # the field's checkpoints: what was read, and how it samples
        gr.Markdown(f"## ditcore sampler\n`{checkpoint}` · {cfg.depth} layers × {cfg.hidden_size} · {conditioning}"
                    + (f"\n\n{imported}" if imported else ""))
        with gr.Row():
            with gr.Column():
                choice = gr.Dropdown(list(models.folders), value=models.default, label="checkpoint",
                                     elem_id="checkpoint", visible=len(models.folders) > 1)
                # the run's first validation prompt, or nothing: a default that names one subject would be wrong
                # for every other model
                prompt = gr.Textbox(label="prompt", value=prompts[0] if prompts else "", elem_id="prompt",
                                    placeholder="describe what to draw", visible=not base.class_conditional)
                negative = gr.Textbox(label="negative prompt", value="", elem_id="negative",
                                      visible=not base.class_conditional)
                # Numbers of precision 0, so the API schema says integer, as the checks require
                class_label = gr.Number(classes[0] if classes else 0, precision=0, minimum=0,
                                        maximum=max(0, cfg.num_classes - 1),
                                        label=f"class (0..{cfg.num_classes - 1})" if cfg.num_classes else "class",
                                        elem_id="class", visible=base.class_conditional)
                if prompts and not base.class_conditional:
                    gr.Examples([[p] for p in prompts], [prompt], label="the run's validation prompts",
                                api_visibility="private")
                if classes:
                    gr.Examples([[c] for c in classes], [class_label], label="the classes the run validated",
                                api_visibility="private")
                steps = gr.Slider(*LIMITS["steps"], value=18, step=1, precision=0, label="steps", elem_id="steps")
                guidance = gr.Slider(*LIMITS["guidance"], value=base.exported.guidance, step=0.1, label="guidance",
                                     elem_id="guidance")
                with gr.Row():
                    seed = gr.Number(value=0, precision=0, label="seed", elem_id="seed")
                    shuffle = gr.Button("random seed", elem_id="random-seed")
                video_model = cfg.max_grid[0] > 1  # an image model (DiT's) samples one frame: no slider to trip on
                # a video VAE that compresses time k-fold decodes 1 + n·k frames (Wan's: 1 + 4n): 1 + 2k of them
                factor = base.exported.codec.temporal_factor
                clip = 8 if factor == 1 else 1 + 2 * factor
                frames = gr.Slider(1, MAX_FRAMES, value=clip if video_model else 1, step=1, precision=0, label="frames",
                                   elem_id="frames", visible=video_model)
                with gr.Row():
                    height = gr.Number(height0, precision=0, minimum=heights[0], maximum=heights[-1], step=stride,
                                       label="height (pixels)", info=f"multiples of {stride} up to {heights[-1]}",
                                       elem_id="height")
                    width = gr.Number(width0, precision=0, minimum=widths[0], maximum=widths[-1], step=stride,
                                      label="width (pixels)", info=f"multiples of {stride} up to {widths[-1]}",
                                      elem_id="width")
                if trained:
                    gr.Examples([list(s) for s in trained], [height, width],
                                label="resolutions the run trained at (height, width)", api_visibility="private")
                solver = gr.Radio(list(SOLVERS), value=base.exported.solver, label="solver", elem_id="solver")
                go = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column():
                video = gr.Video(label="sample", elem_id="vid", autoplay=True, loop=True)
                first = gr.Image(label="first frame", elem_id="first-frame", type="numpy")
                info = gr.Markdown(label="stats", elem_id="info")
        if sheet:
            # its own full-width image: as a gallery thumbnail (a square crop) it lost the prompt labels on its left
            gr.Image(str(sheet), label="contact sheet of the run's validation samples (prompts × seeds)",
                     elem_id="sheet", interactive=False, show_label=True)
        if gallery:
            gr.Gallery([str(p) for p in gallery], label="validation samples from training", columns=8,
                       object_fit="contain", elem_id="gallery")
        shuffle.click(lambda: random.randint(0, 2**31 - 1), outputs=seed, api_visibility="private")
        inputs = [choice, prompt, negative, class_label, steps, guidance, seed, frames, height, width, solver]
        # One queue slot count for both ways in (the page's button, the API): they share the sampling threads
        common = dict(concurrency_limit=concurrency, concurrency_id="sample", preprocess=False)
        go.click(show, inputs, [video, first, info], api_visibility="private", **common)
        # The API endpoint has no trigger on the page: API callers get errors as errors
        gr.on([], run, inputs, [video, first, info], api_name="generate", **common)
    demo.queue(default_concurrency_limit=concurrency, max_size=queue_size)
    return demo
