"""Open a report as its reader will, in headless Chromium with the network cut off, and check what it drew.

A report is read on air-gapped GPU servers, so it must make no request beyond ``file://``; and a figure that
draws is not yet a figure that can be read: an annotation placed in data units on a log axis once stretched an
axis to 10^64 and squeezed every point into its first 8 %. This module renders the page, then asks plotly.js
in the page for every figure's axis ranges and compares them with the figure's data.
"""

from __future__ import annotations

import html as html_lib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pydantic import BaseModel

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
STRETCH_LIMIT = 3.0  # an axis may span at most this many times its data (padding, reference lines, bars from 0)

# Runs in the page once plotly.js has drawn: one entry per figure, its axes against its data.
_PROBE = r"""
<script>
window.addEventListener('load', function () { setTimeout(function () {
  var out = [];
  document.querySelectorAll('.plotly-graph-div').forEach(function (gd, i) {
    var fl = gd._fullLayout, r = {index: i, title: '', drawn: false, problems: []};
    if (fl) {
      var t = gd.layout && gd.layout.title; r.title = (t && (t.text || (typeof t === 'string' ? t : ''))) || '';
      r.drawn = !!gd.querySelector('.main-svg') && (gd._fullData || []).length > 0;
      var extents = {};
      (gd._fullData || []).forEach(function (t) {
        if (t.visible === false || t.visible === 'legendonly') return;
        ['x', 'y'].forEach(function (ax) {
          var name = (t[ax + 'axis'] || ax).replace(ax, ax + 'axis'), a = fl[name];
          // facets share one range (matches): their data belong together, on the axis they follow
          if (a && a.matches) { name = a.matches.replace(ax, ax + 'axis'); a = fl[name]; }
          if (!a || !a.range || ['category', 'multicategory', 'date'].indexOf(a.type) >= 0) return;
          var raw = Array.from(t[ax] || []), vals = raw.filter(function (v) { return typeof v === 'number' && isFinite(v); });
          var err = t['error_' + ax];  // error bars belong to the data the axis must show
          if (err && err.visible && err.type === 'data') {
            var up = Array.from(err.array || []), down = Array.from(err.arrayminus || err.array || []);
            raw.forEach(function (v, k) {
              if (typeof v !== 'number') return;
              if (typeof up[k] === 'number') vals.push(v + up[k]);
              if (typeof down[k] === 'number') vals.push(v - down[k]);
            });
          }
          if (a.type === 'log') vals = vals.filter(function (v) { return v > 0; }).map(Math.log10);
          if (t.type === 'bar' && a.type !== 'log' && ((t.orientation === 'h') === (ax === 'x'))) vals.push(0);
          if (!vals.length) return;
          var e = extents[name] || {lo: Infinity, hi: -Infinity, range: a.range.slice(), type: a.type};
          e.lo = Math.min(e.lo, Math.min.apply(null, vals)); e.hi = Math.max(e.hi, Math.max.apply(null, vals));
          extents[name] = e;
        });
      });
      r.axes = extents;
    }
    out.push(r);
  });
  var pre = document.createElement('pre'); pre.id = 'servebook-figure-check';
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
}, 1500); });
</script>
"""


class FigureCheck(BaseModel):
    index: int
    title: str
    drawn: bool
    problems: list[str]


class BrowserCheck(BaseModel):
    browser: str
    requests: list[str]  # every URL the page asked for beyond file://, data: and the like
    figures: list[FigureCheck]

    @property
    def ok(self) -> bool:
        return not self.requests and all(f.drawn and not f.problems for f in self.figures)

    def problems(self) -> list[str]:
        out = [f"request beyond file://: {url}" for url in self.requests]
        for f in self.figures:
            label = f"figure {f.index + 1} ({f.title or 'untitled'})"
            if not f.drawn:
                out.append(f"{label}: not drawn")
            out += [f"{label}: {p}" for p in f.problems]
        return out


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _axis_problems(axes: dict[str, dict[str, float | str | list[float]]]) -> list[str]:
    problems = []
    for name, e in sorted(axes.items()):
        rng = e["range"]
        assert isinstance(rng, list)
        lo, hi = min(rng), max(rng)
        data_lo, data_hi = float(e["lo"]), float(e["hi"])  # type: ignore[arg-type]
        span = hi - lo
        slack = 1e-6 * max(abs(span), 1.0)
        # A linear axis drawn from zero (plotly's rangemode "tozero") shows sizes against nothing, which a
        # reader expects of throughput and latency: zero counts as data, so only space beyond it is stretch.
        shown_lo, shown_hi = data_lo, data_hi
        if e.get("type") != "log" and lo <= slack and hi > 0 and lo >= -0.1 * hi and data_lo >= 0:
            shown_lo = 0.0
        if data_lo < lo - slack or data_hi > hi + slack:
            problems.append(f"{name} range {lo:.4g}..{hi:.4g} cuts off data {data_lo:.4g}..{data_hi:.4g}")
        elif shown_hi > shown_lo and span > STRETCH_LIMIT * (shown_hi - shown_lo):
            problems.append(
                f"{name} range {lo:.4g}..{hi:.4g} is stretched: the data ({data_lo:.4g}..{data_hi:.4g}) fills "
                f"{(data_hi - data_lo) / span:.0%} of it"
            )
    return problems


def _requests(net_log: Path) -> list[str]:
    """URLs the page asked for beyond local schemes; the browser's own update and sign-in calls (no file://
    origin in their network isolation key) are not the page's."""
    text = net_log.read_text(errors="replace") if net_log.exists() else ""
    try:
        log = json.loads(text)
    except json.JSONDecodeError:  # a log cut short: close it
        log = json.loads(text.rstrip().rstrip(",") + "]}")
    start_job = log.get("constants", {}).get("logEventTypes", {}).get("URL_REQUEST_START_JOB")
    urls = set()
    for event in log.get("events", []):
        params = event.get("params", {})
        if event.get("type") == start_job and "file://" in params.get("network_isolation_key", ""):
            urls.add(params.get("url", ""))
    return sorted(u for u in urls if u and not _local(u))


def _local(url: str) -> bool:
    return url.startswith(("file:", "data:", "blob:", "about:", "chrome:", "devtools:"))


def check(report: Path, timeout_s: float = 120.0, browser: str | None = None) -> BrowserCheck:
    """Render ``report`` offline in headless Chromium; return the requests it made and each figure's check."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium found: install it (apt-get install chromium) to check a report")
    page = Path(report).read_text()
    with tempfile.TemporaryDirectory(prefix="servebook-report-check-") as tmp:
        probe = Path(tmp) / "report.html"
        probe.write_text(page.replace("</body>", _PROBE + "</body>", 1) if "</body>" in page else page + _PROBE)
        net_log = Path(tmp) / "net-log.json"
        command = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # no name resolves: nothing can leave the machine
            f"--log-net-log={net_log}",
            f"--user-data-dir={Path(tmp) / 'profile'}",
            "--virtual-time-budget=20000",
            "--dump-dom",
            probe.as_uri(),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        found = re.search(r'<pre id="servebook-figure-check">(.*?)</pre>', done.stdout, re.S)
        if not found:
            raise RuntimeError(f"the page did not finish drawing in {browser}: {done.stderr.strip()[-500:]}")
        figures = json.loads(html_lib.unescape(found.group(1)))
        return BrowserCheck(
            browser=browser,
            requests=_requests(net_log),
            figures=[
                FigureCheck(
                    index=f["index"],
                    title=f["title"],
                    drawn=f["drawn"],
                    problems=list(f["problems"]) + _axis_problems(f.get("axes", {})),
                )
                for f in figures
            ],
        )
