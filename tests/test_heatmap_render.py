"""The heatmap page renders in headless Chromium (Debian's `chromium`), with coloured tokens on screen."""

import os
import shutil
import subprocess

import pytest

from tests.test_inspection import CharTokenizer, record_for
from trl_mrtpo.inspection import CONTROL_NAME
from trl_mrtpo.viz import credit_heatmap_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs chromium (.ci/run); elsewhere the test is skipped rather than failing on a missing browser.
pytestmark = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium not installed")


def test_heatmap_screenshot(tmp_path):
    from PIL import Image

    assert CHROMIUM, "CI must install Debian's chromium (see .ci/run)"
    text = "The answer is here, end with OK"
    q = [0.01] * (len(text) - 2) + [0.9, 0.9]
    record = record_for(text, q, [0.05] * len(text), advantage=-1.0)
    page = tmp_path / "credit.html"
    page.write_text(
        credit_heatmap_html(record, CharTokenizer(), ["end_phrase_reward", "keyword_reward", CONTROL_NAME])
    )
    shot = tmp_path / "shot.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,700", f"--screenshot={shot}",
         page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    image = Image.open(shot).convert("RGB")
    assert image.size == (1000, 700)
    pixels = list(image.getdata())
    reddish = sum(1 for r, g, b in pixels if r > 180 and g < 120 and b < 120)  # the negative end-phrase tokens
    dark = sum(1 for r, g, b in pixels if r < 90 and g < 90 and b < 90)  # text
    assert reddish > 200 and dark > 500
