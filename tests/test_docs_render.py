"""Slow: the docs site as a reader sees it at 1,400 px, rendered by headless Chromium (Debian's ``chromium``; the
test skips without it). Issue 46, finding 10: the text column was ~600 px, the home page's DAG diagram lost its
right end, and configuration keys wrapped mid-word. A script added to a copy of each page measures the laid-out
page (Chromium's ``--dump-dom`` prints the DOM after it ran)."""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

MEASURE = """<script>
(() => {
  const q = (s) => [...document.querySelectorAll(s)];
  const r = {
    content: document.querySelector('.md-content').getBoundingClientRect().width,
    code: q('.md-typeset pre > code').map((c) => ({overflow: getComputedStyle(c).overflowX,
                                                  cut: c.scrollWidth > c.clientWidth})),
    keys: q('.md-typeset table:not([class]) td:first-child code').map((c) => [c.textContent,
                                                                              c.getClientRects().length]),
  };
  const out = document.createElement('pre');
  out.id = 'layout';
  out.textContent = JSON.stringify(r);
  document.body.appendChild(out);
})();
</script>"""


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no headless Chromium here (apt-get install chromium): the docs' layout is not checked")


def _layout(browser: str, page: Path) -> dict:
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,1100",
                        "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    start = dom.index('<pre id="layout">') + len('<pre id="layout">')
    return json.loads(html.unescape(dom[start : dom.index("</pre>", start)]))


def test_the_docs_at_1400_px_give_the_text_room_scroll_code_and_never_break_a_key(tmp_path):
    browser = _browser()
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    home, config = _layout(browser, site / "index.html"), _layout(browser, site / "configuration" / "index.html")
    for page in (home, config):
        assert page["content"] >= 850, page["content"]  # was 606 px
        assert page["code"] and all(c["overflow"] in ("auto", "scroll") for c in page["code"])  # never cut unseen
    broken = [k for k, lines in config["keys"] if lines > 1]
    assert len(config["keys"]) > 100 and broken == [], broken[:10]
