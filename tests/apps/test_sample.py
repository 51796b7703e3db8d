"""dit-sample as a user runs it: CLI determinism and outputs, the Gradio page in a real headless browser."""

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

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


def test_same_seed_same_output_and_the_requested_frames(checkpoint, tmp_path):
    a, b, c = tmp_path / "a.mp4", tmp_path / "b.mp4", tmp_path / "c.mp4"
    common = ["--checkpoint", checkpoint, "--prompt", "a red butterfly", "--steps", 3, "--frames", 5,
              "--height", 32, "--width", 48]
    for out, seed in ((a, 7), (b, 7), (c, 8)):
        proc = generate(*common, "--seed", seed, "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "5 denoiser evaluations" in proc.stdout  # 3 Heun steps = 2·3 − 1
    fa, fb, fc = read_video(a), read_video(b), read_video(c)
    assert fa.shape == (5, 32, 48, 3)
    assert np.array_equal(fa, fb) and not np.array_equal(fa, fc)


def test_guidance_defaults_to_the_one_the_run_validated_with(checkpoint, tmp_path):
    import json
    import shutil

    own = shutil.copytree(checkpoint / "export", tmp_path / "export")
    meta = json.loads((own / "model.json").read_text())
    (own / "model.json").write_text(json.dumps(meta | {"guidance": 1.0}))  # what dit-train records
    common = ["--prompt", "a red butterfly", "--steps", 2, "--height", 32, "--width", 32, "--out", tmp_path / "s.png"]
    recorded, older = generate("--checkpoint", own, *common), generate("--checkpoint", checkpoint, *common)
    assert recorded.returncode == older.returncode == 0, recorded.stderr[-3000:] + older.stderr[-3000:]
    assert "(1x batch for guidance)" in recorded.stdout  # 1.0: no guidance, as the run validated
    assert "(2x batch for guidance)" in older.stdout  # an export without it: the default weight 4.0


def test_several_prompts_sample_as_one_batch_and_images_are_png(checkpoint, tmp_path):
    proc = generate("--checkpoint", checkpoint / "export", "--prompt", "a red butterfly", "--prompt",
                    "a blue butterfly", "--steps", 2, "--height", 32, "--width", 32, "--out", tmp_path / "s.png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 sample(s) of 1x32x32: 3 denoiser evaluations" in proc.stdout
    assert read_video(tmp_path / "s-0.png").shape == (1, 32, 32, 3) and (tmp_path / "s-1.png").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", 0], "steps=0 is out of range: expected 1..500"),
        (["--guidance", -1], "guidance=-1.0 is out of range"),
        (["--height", 30], "use heights and widths that are multiples of 8"),
        (["--prompt", "  "], "the prompt is empty"),
    ],
)
def test_bad_requests_give_one_clear_line(checkpoint, tmp_path, args, message):
    base = {"--prompt": "a red butterfly", "--steps": 2}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    flat = [x for kv in base.items() for x in kv]
    proc = generate("--checkpoint", checkpoint, *flat, "--out", tmp_path / "x.png")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_missing_or_wrong_checkpoint(tmp_path, checkpoint):
    proc = generate("--checkpoint", tmp_path / "nope", "--prompt", "x")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    other = tmp_path / "other"
    shutil.copytree(checkpoint / "export", other)
    import json

    meta = json.loads((other / "model.json").read_text())
    meta["model"]["depth"] = 3
    (other / "model.json").write_text(json.dumps(meta))
    proc = generate("--checkpoint", other, "--prompt", "x")
    assert proc.returncode == 2 and "weights of another architecture" in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------- the page


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (.ci/run installs it)")
def test_generate_in_a_real_browser(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync"])
        page = browser.new_page()
        page.goto(server)
        page.fill("#prompt textarea", "a blue butterfly")
        page.locator("#frames input[type=number]").fill("6")
        page.locator("#steps input[type=number]").fill("3")
        page.click("#generate")
        page.wait_for_selector("#vid video", timeout=120_000)
        src = page.locator("#vid video").get_attribute("src")
        data = urllib.request.urlopen(src if src.startswith("http") else server.rstrip("/") + src).read()
        (tmp_path / "v.mp4").write_bytes(data)
        assert read_video(tmp_path / "v.mp4").shape[0] == 6
        page.wait_for_function("document.querySelector('#info').innerText.includes('NFE 5')")
        shot = Path(os.environ.get("DIT_SCREENSHOT_DIR", tmp_path)) / "dit-sample-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        page.fill("#prompt textarea", "")
        page.click("#generate")
        page.wait_for_function("document.body.innerText.includes('the prompt is empty')", timeout=60_000)
        browser.close()
    assert urllib.request.urlopen(server, timeout=5).status == 200  # the failing request did not take it down


def test_the_gallery_shows_the_contact_sheet_first(server):
    """The page's gallery of validation samples starts with the run's contact sheet (samples/grid.png)."""
    import json

    config = json.load(urllib.request.urlopen(server.rstrip("/") + "/config", timeout=10))
    gallery = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "gallery")
    names = [Path(item["image"]["path"]).name for item in gallery["props"]["value"]]
    assert names == ["grid.png", "00-a-red-butterfly.png"]


def test_gradio_client(server, tmp_path):
    from gradio_client import Client

    client = Client(server, verbose=False)
    video, _first, info = client.predict("export (final EMA weights)", "a red butterfly", "", 0, 2, 2.0, 3, 4, 32,
                                        "euler", api_name="/generate")
    path = video["video"] if isinstance(video, dict) else video
    assert read_video(path).shape[0] == 4 and "NFE 2" in info and "seed 3" in info
