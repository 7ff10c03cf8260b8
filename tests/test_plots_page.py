"""`dvc plots show` and `dvc plots diff` draw every declared plot, offline, in a real browser.

DVC's own page loads Vega from a CDN; the project's template (.dvc/plots_page.html, rlpipe/plots_page.py)
inlines it. The browser test opens the page in headless Chromium with every host name unresolvable, and
reads back, for each plot, how many pixels its canvas drew. It skips where Chromium is not installed
(Debian: `apt install chromium`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlpipe.plots_page import LIBRARIES, TEMPLATE
from scratch import dvc

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)

# Appended to a copy of the page: once vega-embed has drawn, the body records each plot's drawn pixels.
PROBE = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const drawn = {};
  for (const div of document.querySelectorAll('body > div[id]')) {
    const canvas = div.querySelector('canvas');
    let pixels = 0;
    if (canvas) {
      const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
      for (let i = 3; i < data.length; i += 4) if (data[i] > 0) pixels++;
    }
    drawn[div.id] = pixels;
  }
  document.body.setAttribute('data-drawn', JSON.stringify(drawn));
}, 1500));
</script>
"""


def drawn_pixels(page: Path) -> dict[str, int]:
    """Each plot's drawn canvas pixels when Chromium opens `page` with no network."""
    probed = page.with_name("probed.html")
    head, _, tail = page.read_text(encoding="utf-8").rpartition("</body>")  # vega-embed's code holds the tag too
    probed.write_text(head + PROBE + "</body>" + tail, encoding="utf-8")
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=20000", "--dump-dom",
                           probed.as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'data-drawn="([^"]*)"', done.stdout)
    assert found, f"the probe did not run:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"'))


def declared_plots(root: Path) -> list[str]:
    return [next(iter(p)) for stage in yaml.safe_load((root / "dvc.yaml").read_text())["stages"].values()
            for p in stage.get("plots", [])]


def test_the_template_inlines_what_dvc_would_load_from_its_cdn():
    from dvc_render.vega import VegaRenderer

    cdn = dict(re.findall(r"cdn\.jsdelivr\.net/npm/([\w-]+)@([\d.]+)", VegaRenderer.SCRIPTS))
    assert cdn == {lib.name: lib.version for lib in LIBRARIES}
    page = (REPO / TEMPLATE).read_text(encoding="utf-8")
    assert "{plot_divs}" in page and "{scripts}" not in page  # DVC's CDN tags have nowhere to go
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)  # nothing loaded from elsewhere
    for lib in LIBRARIES:
        assert f"<script>/* {lib.name} {lib.version} */" in page
    assert "plots_page.html" in (REPO / ".dvc/config").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt install chromium) to draw the page")
@pytest.mark.parametrize("command", ["show", "diff"])
def test_dvc_plots_draw_every_declared_plot_offline(mini_run, tmp_path, command):
    root, _ = mini_run
    out = tmp_path / command
    dvc(root, "plots", command, "-o", str(out))
    assert "Held-out greedy pass@1 per round" in (out / "index.html").read_text(encoding="utf-8")
    drawn = drawn_pixels(out / "index.html")
    assert len(drawn) == len(declared_plots(root)) >= 1, drawn
    assert all(pixels > 1000 for pixels in drawn.values()), drawn


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt install chromium) to draw the page")
def test_dvc_s_own_page_draws_nothing_offline(mini_run, tmp_path):
    """Why the template exists: with DVC's default page, the CDN is unreachable and no plot draws."""
    from dvc_render.html import PAGE_HTML

    root, _ = mini_run
    default = tmp_path / "default.html"
    default.write_text(PAGE_HTML)
    dvc(root, "plots", "show", "--html-template", str(default), "-o", str(tmp_path / "cdn"))
    drawn = drawn_pixels(tmp_path / "cdn" / "index.html")
    assert drawn and all(pixels == 0 for pixels in drawn.values()), drawn
