"""The built docs site read the way people read it: headless Chromium (Debian's package) over the Chrome DevTools
Protocol on a pipe (``--remote-debugging-pipe``: no websocket library, no open debugging port), each page loaded
from a local HTTP server, inspected in the page, and screenshotted.

Per page it reports:

- ``raw``: Sphinx roles (a role shows as a bare ``:class:`` prefix before a code span) and literal ``**`` in
  the rendered text outside code;
- ``inline_lists``: a paragraph holding a Markdown list item that did not become a list (``... - **refused** ...``);
- ``console``: console errors, uncaught exceptions, failed loads;
- ``wide_code``: code blocks wider than their column (content cut off, or a horizontal scroll bar);
- ``broken_code``: inline code wrapped inside a token (a line break between two non-space characters);
- ``argument_tables``: how many parameter tables an API page renders; ``nav``: the pages the navigation links to.

Usage: ``python tools/docs_browser.py SITE_DIR OUT_DIR [PAGE ...]`` (pages relative to the site, e.g.
``reference/api/``) prints one JSON object per page and writes ``OUT_DIR/<page>.png``.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", "--mute-audio", "--hide-scrollbars", "--remote-debugging-pipe"]
WIDTH, HEIGHT, MAX_SHOT_HEIGHT = 1440, 900, 6000  # a common laptop screen (13-inch at its default scaling)

# Runs in the page after its load event. Text outside <code>/<pre> is what a reader sees as prose.
PROBE = r"""
(() => {
  const article = document.querySelector("article") || document.body;
  const prose = [];
  const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.parentElement.closest("code, pre, script, style, .headerlink")) prose.push(n.textContent);
  }
  const text = prose.join("");
  const around = (re) => [...text.matchAll(re)].map(m => text.slice(Math.max(0, m.index - 40), m.index + 60));
  const inline = [...article.querySelectorAll("p, td, li")].filter(p =>
      /\n\s*([-*+]|\d+\.) +\S/.test([...p.childNodes].filter(c => c.nodeType === 3).map(c => c.textContent).join("")))
    .map(p => p.textContent.slice(0, 120));
  const wide = [...article.querySelectorAll("pre")].filter(pre => {
      const code = pre.querySelector("code") || pre;
      return code.scrollWidth > code.clientWidth + 1 || pre.scrollWidth > pre.clientWidth + 1;
    }).map(pre => ({width: (pre.querySelector("code") || pre).scrollWidth, column: pre.clientWidth,
                    first: pre.textContent.split("\n").sort((a, b) => b.length - a.length)[0].slice(0, 100)}));
  const brokenAt = (code) => {  // where the line wraps inside a token: between two non-space characters
    if (code.getClientRects().length < 2) return null;
    const text = code.textContent, range = document.createRange();
    let top = null, offset = 0;
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      for (let i = 0; i < n.length; i++, offset++) {
        range.setStart(n, i);
        range.setEnd(n, i + 1);
        const rect = range.getClientRects()[0];
        if (!rect || !rect.width) continue;
        if (top !== null && rect.top > top + 1 && /\S/.test(text[offset - 1] || " ") && /\S/.test(text[offset]))
          return text.slice(Math.max(0, offset - 30), offset) + "|" + text.slice(offset, offset + 30);
        top = rect.top;
      }
    }
    return null;
  };
  const broken = [...article.querySelectorAll("code")].filter(c => !c.closest("pre")).map(brokenAt)
    .filter(Boolean);
  const nav = [...document.querySelectorAll("nav.md-nav--primary a.md-nav__link[href]")]
    .map(a => new URL(a.getAttribute("href"), location.href).pathname);
  return {
    title: document.title,
    raw: around(/:(py:)?(class|func|meth|attr|mod|data|exc|obj):/g).concat(around(/\*\*/g)),
    inline_lists: inline,
    wide_code: wide,
    broken_code: broken,
    argument_tables: article.querySelectorAll("table.field-list, .doc-section-parameters, table").length &&
      [...article.querySelectorAll("table")].filter(t => /Name/.test(t.querySelector("th")?.textContent || "")
        && /Description/.test(t.textContent)).length,
    nav: [...new Set(nav)],
    height: Math.ceil(Math.max(document.documentElement.scrollHeight,  // the page, or the whole navigation
      (document.querySelector(".md-sidebar--primary .md-sidebar__scrollwrap")?.scrollHeight || 0) + 160)),
  };
})()
"""


def chromium_binary():
    """Debian's ``chromium`` (or a ``chromium-browser`` / ``google-chrome``) on the PATH, else None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


class Site:
    """The built site served over HTTP on 127.0.0.1 (a thread of this process) for the pages' scripts to run as
    they do on a web host (the search worker does not start from ``file://``)."""

    def __init__(self, root: Path):
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, page: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{page}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class Browser:
    """One headless Chromium spoken to over CDP on fds 3 (commands) and 4 (replies and events), its own profile
    directory; ended (its process group killed) on exit."""

    def __init__(self, binary: str, timeout: float = 60.0):
        self.timeout, self.next_id, self.pending = timeout, 0, b""
        self.profile = tempfile.mkdtemp(prefix="docs-browser-profile-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()

        def pipes_at_3_and_4():  # in the child: high copies first, so neither dup2 overwrites the other's source
            high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=pipes_at_3_and_4, close_fds=False, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.events = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for fd in (self.to_browser, self.from_browser):
            os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self.pending:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self.from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed its pipe (exit code {self.proc.poll()})")
            self.pending += chunk
        message, self.pending = self.pending.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """One CDP command's result; events that arrive meanwhile are kept in ``events``."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for i, event in enumerate(self.events):
            if event.get("method") == method and event.get("sessionId") == session:
                return self.events.pop(i)
        while True:
            event = self._read_message(deadline)
            if event.get("method") == method and event.get("sessionId") == session:
                return event
            self.events.append(event)


def _console_errors(events, session):
    errors = []
    for event in events:
        if event.get("sessionId") != session:
            continue
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            errors.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}".strip())
    return errors


def inspect_page(browser: Browser, url: str, screenshot: Path) -> dict:
    """Load ``url`` in a fresh tab, run the probe, save a full-page screenshot (up to MAX_SHOT_HEIGHT pixels)."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    try:
        for domain in ("Page", "Runtime", "Log"):
            browser.send(f"{domain}.enable", session=session)
        browser.send("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": HEIGHT,
                                                            "deviceScaleFactor": 1, "mobile": False}, session=session)
        browser.events.clear()
        browser.send("Page.navigate", {"url": url}, session=session)
        browser.wait_for("Page.loadEventFired", session)
        browser.send("Runtime.evaluate", {"expression": "document.fonts.ready", "awaitPromise": True}, session=session)
        report = browser.send("Runtime.evaluate", {"expression": PROBE, "returnByValue": True},
                              session=session)["result"]["value"]
        height = min(report["height"], MAX_SHOT_HEIGHT)  # a window as tall as the page: all of it painted
        browser.send("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": height,
                                                            "deviceScaleFactor": 1, "mobile": False}, session=session)
        browser.send("Runtime.evaluate", {"expression": "new Promise(r => requestAnimationFrame(() => r(1)))",
                                          "awaitPromise": True}, session=session)
        shot = browser.send("Page.captureScreenshot", {
            "format": "png", "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1}}, session=session)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        report["console"] = _console_errors(browser.events, session)
        report["screenshot"] = str(screenshot)
        return report
    finally:
        browser.send("Target.closeTarget", {"targetId": target})


def inspect_site(site_dir: Path, out_dir: Path, pages, binary: str) -> dict:
    """``{page: report}`` for each page of the built site ``site_dir``; screenshots under ``out_dir``."""
    reports = {}
    with Browser(binary) as browser, Site(site_dir) as site:  # the browser forks before the server's thread starts
        for page in pages:
            name = page.strip("/").replace("/", "_") or "index"
            reports[page] = inspect_page(browser, site.url(page), out_dir / f"{name}.png")
    return reports


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    binary = chromium_binary()
    if binary is None:
        print("no chromium on the PATH: `apt-get install -y chromium` (Debian's package)", file=sys.stderr)
        return 2
    pages = argv[2:] or [""]
    for page, report in inspect_site(Path(argv[0]), Path(argv[1]), pages, binary).items():
        print(json.dumps({"page": page, **report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
