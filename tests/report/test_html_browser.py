"""``fedpeft report --html`` as a browser shows it: Debian's Chromium, headless and offline,
renders the page to a PNG (kept under ``$FEDPEFT_SCREENSHOT_DIR`` when set, to be looked at).
Marked ``browser``: ``bash scripts/chromium.sh`` installs the browser; .ci/run runs it."""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedpeft.experiment import run
from fedpeft.report.html import write_report

pytestmark = pytest.mark.browser


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no Chromium on PATH: bash scripts/chromium.sh installs Debian's package")


def test_the_html_report_renders_in_headless_chromium(tiny_config, tmp_path):
    runs = []
    for method in {"fedlr": "LoRA", "fedbf": "biases"}:
        cfg = tiny_config(method={"name": method}, output_dir=str(tmp_path / method), name=f"tiny-{method}",
                          log__plots=True)  # fmt: skip
        run(cfg)
        runs.append(cfg.output_dir)
    page = write_report(runs, [d.name for d in runs], tmp_path / "report.html")
    shot = Path(os.environ.get("FEDPEFT_SCREENSHOT_DIR", tmp_path)) / "report.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    command = [
        chromium(),
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1280,2200",
        f"--screenshot={shot}",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.shape == (2200, 1280)
    # Not a blank page: dark text and plot lines on white, over much of its height
    dark_rows = (pixels < 128).any(axis=1)
    assert dark_rows.mean() > 0.3, f"only {dark_rows.mean():.0%} of the rows hold anything dark"
    # The plots are in colour: matplotlib's default blue and orange lines are drawn
    rgb = np.asarray(Image.open(shot).convert("RGB"), dtype=int)
    blue = (np.abs(rgb - [31, 119, 180]).sum(axis=2) < 40).sum()
    orange = (np.abs(rgb - [255, 127, 14]).sum(axis=2) < 40).sum()
    assert blue > 200 and orange > 200, (blue, orange)
