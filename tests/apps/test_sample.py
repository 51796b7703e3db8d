"""dit-sample as a user runs it: CLI determinism and outputs, the Gradio page in a real headless browser."""

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from ditcore.media import read_video

BIN = Path(sys.executable).parent
CHROMIUM = "/usr/bin/chromium"


def env():
    return {**os.environ, "PYTHONWARNINGS": "ignore", "GRADIO_ANALYTICS_ENABLED": "False"}


def generate(*args):
    return subprocess.run([str(BIN / "dit-sample"), "generate", *map(str, args)], capture_output=True, text=True,
                          env=env(), timeout=300)


@pytest.mark.slow  # 45 s on 2 cores: make test-slow, which CI runs
def test_same_seed_same_output_and_the_requested_frames(checkpoint, tmp_path):
    a, b, c = tmp_path / "a.mp4", tmp_path / "b.mp4", tmp_path / "c.mp4"
    common = ["--checkpoint", checkpoint, "--prompt", "a red butterfly", "--steps", 3, "--frames", 5,
              "--height", 32, "--width", 48]
    for out, seed in ((a, 7), (b, 7), (c, 8)):
        proc = generate(*common, "--seed", seed, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "5 denoiser evaluations" in proc.stdout  # 3 Heun steps = 2·3 − 1
    assert "sampling: 100%" in proc.stderr and "3/3" in proc.stderr  # the progress bar, over the steps
    # Generation time is reported apart from loading: the text encoder's seconds of loading (the import of
    # transformers) were counted as sampling time before
    generated = float(re.search(r"generated in ([\d.]+) s", proc.stdout)[1])
    loading = re.search(r"loading took [\d.]+ s \(model ([\d.]+) s, codec ([\d.]+) s, text encoder ([\d.]+) s\)",
                        proc.stdout)
    assert loading and generated < float(loading[3]), proc.stdout
    fa, fb, fc = read_video(a), read_video(b), read_video(c)
    assert fa.shape == (5, 32, 48, 3)
    assert np.array_equal(fa, fb) and not np.array_equal(fa, fc)


def test_guidance_defaults_to_the_one_the_run_validated_with(cli_in_process, checkpoint, tmp_path):
    import json
    import shutil

    own = shutil.copytree(checkpoint / "export", tmp_path / "export")
    meta = json.loads((own / "model.json").read_text())
    (own / "model.json").write_text(json.dumps(meta | {"guidance": 1.0}))  # what dit-train records
    common = ["--prompt", "a red butterfly", "--steps", 2, "--height", 32, "--width", 32, "--out", tmp_path / "s.png"]
    recorded, older = (cli_in_process("sample", "generate", "--checkpoint", p, *common) for p in (own, checkpoint))
    assert recorded.returncode == older.returncode == 0, recorded.stderr[-3000:] + older.stderr[-3000:]
    assert "(1x batch for guidance)" in recorded.stdout  # 1.0: no guidance, as the run validated
    assert "(2x batch for guidance)" in older.stdout  # an export without it: the default weight 4.0


def test_several_prompts_sample_as_one_batch_and_images_are_png(cli_in_process, checkpoint, tmp_path):
    """And without --height/--width, at the size the run trained at most: 32x48 pixels (not a fixed 64x64)."""
    proc = cli_in_process("sample", "generate", "--checkpoint", checkpoint / "export", "--prompt", "a red butterfly",
                          "--prompt", "a blue butterfly", "--steps", 2, "--out", tmp_path / "s.png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 sample(s) of 1x32x48: 3 denoiser evaluations" in proc.stdout
    assert read_video(tmp_path / "s-0.png").shape == (1, 32, 48, 3) and (tmp_path / "s-1.png").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", 0], "steps=0 is out of range: expected 1..500"),
        (["--guidance", -1], "guidance=-1.0 is out of range"),
        (["--height", 30], "use heights and widths that are multiples of 8"),
        # the example is the run's own first validation prompt (recorded in its export), not a fixed subject
        (["--prompt", "  "], "the prompt is empty: describe what to draw, e.g. 'a green leaf on sand'"),
    ],
)
def test_bad_requests_give_one_clear_line(cli_in_process, checkpoint, tmp_path, args, message):
    base = {"--prompt": "a red butterfly", "--steps": 2}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    flat = [x for kv in base.items() for x in kv]
    proc = cli_in_process("sample", "generate", "--checkpoint", checkpoint, *flat, "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_missing_or_wrong_checkpoint(cli_in_process, tmp_path, checkpoint):
    proc = cli_in_process("sample", "generate", "--checkpoint", tmp_path / "nope", "--prompt", "x")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    other = tmp_path / "other"
    shutil.copytree(checkpoint / "export", other)
    import json

    meta = json.loads((other / "model.json").read_text())
    meta["model"]["depth"] = 3
    (other / "model.json").write_text(json.dumps(meta))
    proc = cli_in_process("sample", "generate", "--checkpoint", other, "--prompt", "x")
    assert proc.returncode == 2 and "weights of another architecture" in proc.stderr, proc.stderr[-2000:]


def test_examples_come_from_the_run_and_older_exports_read_its_config(make_export, tmp_path):
    """Exports from before dit-train recorded its validation prompts take them from the run's config.yaml beside
    export/; an export alone has none, and then no message names an example. A class-conditional model's examples
    are the classes the run validated (one per prompt). Loading them loads no text encoder."""
    from dit_sample.generate import RequestError, Sampler

    request = dict(steps=2, guidance=1.0, frames=1, height=32, width=32)
    sampler = Sampler.load(make_export(tmp_path / "run"))
    assert sampler.prompts() == [] and sampler.default_size() == (64, 64)  # nothing recorded: 64² (offered)
    with pytest.raises(RequestError, match=r"^the prompt is empty: describe what to draw$"):
        sampler.check(prompts=[" "], **request)
    (tmp_path / "run" / "config.yaml").write_text("validation:\n  prompts: [a grey stone, a green leaf]\n")
    assert sampler.prompts() == ["a grey stone", "a green leaf"]
    with pytest.raises(RequestError, match=r"^the prompt is empty: describe what to draw, e.g. 'a grey stone'$"):
        sampler.check(prompts=[" "], **request)
    classes = Sampler.load(make_export(tmp_path / "classes", num_classes=4))
    (tmp_path / "classes" / "config.yaml").write_text("validation:\n  prompts: [cat, dog, fish]\n")
    assert classes.example_classes() == [0, 1, 2]
    assert "text encoder" not in sampler.load_seconds | classes.load_seconds


# ---------------------------------------------------------------- the page


STOP_S = 20  # the most seconds from a signal to the exit: one sampler step, then the one line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_generate_at_the_next_step_and_writes_nothing(make_export, signalled, tmp_path, sig):
    """Ctrl-C or SIGTERM while it samples (500 Heun steps: a minute or more on 2 cores): stopped at the next step,
    one line, exit 128 + the signal, no file. Before: SIGTERM ended it without a word."""
    run = make_export(tmp_path / "run", num_classes=4)  # class-conditional: no text encoder to load
    out = tmp_path / "s.png"
    cmd = [BIN / "dit-sample", "generate", "--checkpoint", run, "--class", 1, "--steps", 500, "--height", 64,
           "--width", 64, "--out", out]
    proc = signalled(cmd, sig, lambda err: re.search(r"sampling: .*\b[1-9]\d*/500", err), env=env())
    said = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[sig]
    lines = [ln for ln in proc.err.replace("\r", "\n").splitlines() if ln.startswith("error")]  # past the bar
    assert proc.returncode == 128 + sig and "Traceback" not in proc.err, proc.err[-3000:]
    assert lines == [f"error: interrupted by {said} — no sample was written to {out}"], lines
    assert not out.exists() and proc.seconds < STOP_S


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (.ci/run installs it)")
def test_generate_in_a_real_browser(server, checkpoint, tmp_path):
    """The page as a person uses it: defaults from the run, a sample, a refused request that leaves it in place."""
    import json

    from playwright.sync_api import sync_playwright

    prompts = json.loads((checkpoint / "export" / "model.json").read_text())["prompts"]  # as dit-train records them

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync"])
        page = browser.new_page()
        page.goto(server)
        # Defaults from the run: its first validation prompt, its examples, its most common training size (non-square)
        assert page.input_value("#prompt textarea") == prompts[0]
        for prompt in prompts:  # offered as examples
            page.get_by_text(prompt, exact=True).first.wait_for(timeout=10_000)
        assert "butterfly" not in page.inner_text("body")
        assert (page.input_value("#height input"), page.input_value("#width input")) == ("32", "48")
        page.fill("#prompt textarea", "a blue butterfly")
        page.locator("#frames input[type=number]").fill("6")
        page.locator("#steps input[type=number]").fill("3")
        page.click("#generate")
        page.wait_for_selector("#vid video", timeout=120_000)
        src = page.locator("#vid video").get_attribute("src")
        data = urllib.request.urlopen(src if src.startswith("http") else server.rstrip("/") + src).read()
        (tmp_path / "v.mp4").write_bytes(data)
        assert read_video(tmp_path / "v.mp4").shape == (6, 32, 48, 3)
        page.wait_for_function("document.querySelector('#info').innerText.includes('NFE 5')")
        stats = page.inner_text("#info")
        shot = Path(os.environ.get("DIT_SCREENSHOT_DIR", tmp_path)) / "dit-sample-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        # A refused request says why and leaves the last good result as it was: video, first frame, stats line
        page.fill("#prompt textarea", "")
        page.click("#generate")
        page.wait_for_function("document.body.innerText.includes('the prompt is empty: describe what to draw, "
                               f"e.g. \\'{prompts[0]}\\'')", timeout=60_000)
        page.wait_for_timeout(500)  # an error status would reach the outputs with the message
        assert page.locator("#vid video").get_attribute("src") == src and page.inner_text("#info") == stats
        assert all("Error" not in page.inner_text(f"#{e}") for e in ("vid", "first-frame", "info"))
        assert page.locator("#first-frame img").count() == 1
        # The contact sheet is shown whole: every pixel of it, its prompt labels on the left included, in view
        sheet = iio.imread(checkpoint / "samples" / "grid.png")
        box = page.locator("#sheet img").evaluate(
            "e => { const r = e.getBoundingClientRect(); return [e.naturalWidth, e.naturalHeight, r.width, r.height,"
            " getComputedStyle(e).objectFit]; }")
        natural, shown, fit = box[:2], box[2:4], box[4]
        assert natural == [sheet.shape[1], sheet.shape[0]], box
        # as large as the sheet or scaled with its aspect kept, unless fitted whole into a box of another shape
        assert fit in ("contain", "scale-down") or abs(shown[0] / shown[1] - natural[0] / natural[1]) < 0.02, box
        browser.close()
    assert urllib.request.urlopen(server, timeout=5).status == 200  # the failing request did not take it down


def test_the_contact_sheet_has_its_own_image_and_the_gallery_fits_images_whole(server):
    """The run's contact sheet (samples/grid.png) is its own image, not a gallery thumbnail (a square crop that hid
    its prompt labels); the gallery shows the validation images whole."""
    import json

    config = json.load(urllib.request.urlopen(server.rstrip("/") + "/config", timeout=10))
    props = {c["props"]["elem_id"]: c["props"] for c in config["components"] if c.get("props", {}).get("elem_id")}
    assert Path(props["sheet"]["value"]["path"]).name == "grid.png"
    assert [Path(item["image"]["path"]).name for item in props["gallery"]["value"]] == ["00-a-green-leaf-on-sand.png"]
    assert props["gallery"]["object_fit"] == "contain"


def test_the_api_has_named_endpoints_whose_types_match_what_the_server_accepts(server, tmp_path):
    from gradio_client import Client

    client = Client(server, verbose=False)
    api = client.view_api(return_format="dict", print_info=False)
    assert list(api["named_endpoints"]) == ["/generate"] and not api["unnamed_endpoints"]  # no /lambda
    endpoint = api["named_endpoints"]["/generate"]
    types = {p["parameter_name"]: p["type"]["type"] for p in endpoint["parameters"]}
    assert types == {"choice": "string", "prompt": "string", "negative": "string", "class_label": "integer",
                     "steps": "integer", "guidance": "number", "seed": "integer", "frames": "integer",
                     "height": "integer", "width": "integer", "solver": "string"}
    assert [r["label"] for r in endpoint["returns"]] == ["sample", "first frame", "stats"]  # no value_23
    video, _first, info = client.predict("export (final EMA weights)", "a red butterfly", "", 0, 2, 2.0, 3, 4, 32,
                                         48, "euler", api_name="/generate")
    path = video["video"] if isinstance(video, dict) else video
    assert read_video(path).shape == (4, 32, 48, 3) and "NFE 2" in info and "seed 3" in info
