"""`dit-sample eval`: the FID (or FD_DINOv2) of a run's EMA weights (its export, or a training checkpoint's) against a
reference, written under RUN/eval/.

Samples decode with the run's own codec; a dataset reference decodes its latents with the dataset's codec, the same
decoder (ditcore.eval.reference). Class-conditional models sample classes drawn uniformly with the seed;
text-conditioned ones the prompts the run validated with (recorded in the export), cycled: the reference's captions
are another distribution of prompts, so a text model's figure compares like with like only between runs that
validate with the same prompts. Under torchrun, the N samples are split over the ranks and the sums reduced over
them (ditcore.eval.sampled).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dit_sample.generate import RequestError, Sampler
from ditcore import durable, runs, stopping
from ditcore.eval import FIGURE, FrechetDistance, SamplePlan, feature_net, load_reference, score_samples
from ditcore.sampling import step_bar, token_grid

EVAL = "eval"


def evaluate(checkpoint: str | Path, reference: str | Path, num: int, *, features: str = "inception",
             weights: str | None = None, steps: int = 18, guidance: float | None = None, seed: int = 0,
             batch: int = 16, height: int | None = None, width: int | None = None,
             say: Callable[[str], None] | None = None) -> tuple[dict, Path | None]:
    """Score `num` samples; returns the result and the JSON file written (rank 0; None on the other ranks). `say`
    (rank 0): told which checkpoint a run directory without an export is scored from."""
    if num < 2:
        raise RequestError(f"--num {num}: a Fréchet distance needs at least 2 samples (a covariance); FID is "
                           "usually reported for 50000 (FID-50K), 10000 for a quicker figure")
    if batch < 1:
        raise RequestError(f"--batch {batch}: expected at least 1")
    started = _start_processes()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    try:
        sampler = Sampler.load(checkpoint)
        if say is not None and rank == 0 and sampler.chosen(checkpoint):
            say(sampler.chosen(checkpoint))
        model = sampler.exported.model.to(device)
        net = feature_net(features, weights)
        ref = _reference(reference, net, height, width, device, rank)
        height, width = _size(sampler, ref, reference, height, width)
        try:
            token_grid(model, sampler.exported.codec, 1, height, width)
        except ValueError as e:
            raise RequestError(f"the reference's images are {height}x{width}, which this model cannot sample: {e}"
                               ) from None
        states = _prompt_states(sampler)
        guidance = sampler.exported.guidance if guidance is None else guidance
        plan = SamplePlan(num, height, width, steps=steps, guidance=guidance, seed=seed, batch=batch)
        distance = FrechetDistance(net, ref, device=device, holds_reference=rank == 0)
        t0 = time.perf_counter()
        with step_bar(len(plan.batches(rank, world)) * steps, f"{FIGURE[features]} samples", disable=rank != 0) as bar:
            value = score_samples(model, sampler.exported.codec, sampler.exported.stats, distance, plan,
                                  text_states=states, rank=rank, world=world, callback=stopping.checked(bar),
                                  **sampler.exported.sampling())
        result = {"what": FIGURE[features], "value": value, "step": sampler.exported.extra.get("step"), "num": num,
                  "features": net.name, "reference": str(reference), "reference_n": ref.n, "height": height,
                  "width": width, "steps": steps, "guidance": guidance, "seed": seed, "ranks": world,
                  "checkpoint": str(sampler.path), "seconds": round(time.perf_counter() - t0, 2)}
        written = _write(sampler.path, result) if rank == 0 else None
        return result, written
    finally:
        if started:
            dist.destroy_process_group()


def _start_processes() -> bool:
    """Under torchrun (WORLD_SIZE > 1) join the other ranks; True if this call started the process group."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or dist.is_initialized():
        return False
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def _reference(reference, net, height, width, device, rank):
    """Rank 0 computes (or reads) the statistics first and caches them; the others then read its cache."""
    kwargs = {"net": net, "height": height, "width": width, "device": device}
    if rank == 0:
        with tqdm(desc="reference images", unit="image", dynamic_ncols=True, leave=False) as bar:
            ref = load_reference(reference, net.name, progress=stopping.checked(bar.update), **kwargs)
    if dist.is_initialized():
        dist.barrier()
    return ref if rank == 0 else load_reference(reference, net.name, **kwargs)  # the cache rank 0 wrote


def _size(sampler: Sampler, ref, reference, height, width) -> tuple[int, int]:
    """The reference's image size; else (an .npz does not record it) --height/--width or the run's own size."""
    if ref.height is None:
        default = sampler.default_size()
        return height or default[0], width or default[1]
    if (height or ref.height, width or ref.width) != (ref.height, ref.width):
        raise RequestError(f"--height/--width {height or ref.height}x{width or ref.width} differ from the "
                           f"reference '{reference}', whose images are {ref.height}x{ref.width}: FID compares "
                           "images of one size — leave them out, or pass a reference of that size")
    return ref.height, ref.width


def _prompt_states(sampler: Sampler) -> list[torch.Tensor] | None:
    if sampler.text is None:
        return None
    prompts = sampler.prompts()
    if not prompts:
        raise RequestError(f"'{sampler.path}' records no validation prompts to sample its text-conditioned model "
                           "with — evaluate a run dit-train exported (it records validation.prompts)")
    sampler.load_text()
    return sampler.text.encode(prompts)


def _write(export: Path, result: dict) -> Path:
    """RUN/eval/<what>-<features>-step<step>-n<num>.json (beside the export folder, or the checkpoints/ folder of a
    training checkpoint), written atomically."""
    if runs.is_complete(export):
        folder = export.parent.parent / EVAL
    else:
        folder = (export.parent if export.name == runs.EXPORT or export.is_file() else export) / EVAL
    durable.make_writable_dir(folder)
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in result["features"])
    path = folder / f"{result['what'].lower()}-{slug}-step{result['step']}-n{result['num']}.json"
    durable.replace_text(path, json.dumps(result, indent=1))
    return path
