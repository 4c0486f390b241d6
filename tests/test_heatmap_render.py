"""The heatmap page renders in headless Chromium (Debian's `chromium`) and shows what it says it shows."""

import os
import shutil
import subprocess

import pytest

from tests.helpers import CharTokenizer, record_for
from trl_mrtpo.observability.viz import credit_heatmap_html
from trl_mrtpo.scripts.inspection import CONTROL_NAME

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs chromium (.ci/run); elsewhere the test is skipped rather than failing on a missing browser.
pytestmark = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium not installed")
TEXT = "The answer is here, all of it written out plainly, and it ends with OK"
NAMES = ["end_phrase_reward", "keyword_reward", CONTROL_NAME]


def screenshot(tmp_path, record, name):
    from PIL import Image

    assert CHROMIUM, "CI must install Debian's chromium (see .ci/run)"
    page, shot = tmp_path / f"{name}.html", tmp_path / f"{name}.png"
    page.write_text(credit_heatmap_html(record, CharTokenizer(), NAMES))
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,700", f"--screenshot={shot}",
         page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    image = Image.open(shot).convert("RGB")
    assert image.size == (1000, 700)
    pixels = list(zip(*[iter(image.tobytes())] * 3))  # (r, g, b) per pixel, in every Pillow version
    return {
        "red": sum(1 for r, g, b in pixels if r > 180 and g < 120 and b < 120),
        "green": sum(1 for r, g, b in pixels if g > 120 and r < 90 and b < 120),
        "blue": sum(1 for r, g, b in pixels if b > 180 and r < 110 and g < 130),
        "dark": sum(1 for r, g, b in pixels if r < 90 and g < 90 and b < 90),
    }


def test_negative_credit_shows_red_on_the_tokens_it_lands_on(tmp_path):
    q = [0.01] * (len(TEXT) - 2) + [0.9, 0.9]
    counts = screenshot(tmp_path, record_for(TEXT, q, [0.05] * len(TEXT), advantage=-1.0), "negative")
    assert counts["red"] > 200 and counts["dark"] > 500


def test_where_a_reward_looks_shows_even_when_its_advantage_is_zero(tmp_path):
    # Advantage 0: no token gets credit, so no background is coloured; the replayed rewards' q still shows as blue
    # bars under the tokens (here 24 characters of the control's q, 2 of the end phrase's), beside their colour bars.
    q = [0.01] * (len(TEXT) - 2) + [0.9, 0.9]
    q_control = [0.02] * 20 + [0.6] * 24 + [0.02] * (len(TEXT) - 44)
    counts = screenshot(tmp_path, record_for(TEXT, q, q_control, advantage=0.0), "zero")
    assert counts["red"] == 0 and counts["green"] == 0
    assert counts["blue"] > 1200  # two q colour bars are ~600 px; 26 barred tokens add ~1000
    uniform = record_for(TEXT, q, q_control, advantage=0.0)
    uniform.replayed[:] = False  # nothing replayed: no q to show, no q colour bar
    assert screenshot(tmp_path, uniform, "uniform")["blue"] == 0
