"""The project's own JupyterLab (from .venv), driven in Debian's headless Chromium through chromium-driver.

The lab serves a copy of notebooks/ and params/ (JupyterLab autosaves: the committed notebooks must never gain
outputs), with SERVEBOOK_OUTPUTS pointing into the test's folder. The page exposes JupyterLab's application
object (``expose_app_in_browser``), so the test runs cells through JupyterLab's own commands, as a person's
menu clicks do, and reads the state the page shows.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
JUPYTER = Path(sys.executable).parent / "jupyter"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

BUSY_JS = """
const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!w || !w.sessionContext || !w.sessionContext.session || !w.sessionContext.session.kernel) return 'no kernel';
const status = w.sessionContext.session.kernel.status;
const running = w.content.widgets.some(c => c.model.type === 'code' && c.promptNode &&
                                        c.promptNode.textContent.includes('*'));
return running ? 'running' : status;
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available() -> str:
    """Why the browser tests cannot run here, or '' when they can."""
    missing = [
        name for name, path in (("chromium", CHROMIUM), ("chromium-driver", CHROMEDRIVER)) if not Path(path).exists()
    ]
    if missing:
        return f"{' and '.join(missing)} missing (scripts/test.sh installs them with apt)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (servebook[dev])"
    return ""


class Lab:
    """One JupyterLab server over a copy of the workbook, and one headless browser on it."""

    def __init__(
        self,
        root: Path,
        shots: Path,
        env: dict[str, str] | None = None,
        command: Callable[[int], list[str]] | None = None,
    ) -> None:
        """``command`` (of the port): JupyterLab as ``servebook lab`` starts it (its own root, the notebooks at the
        top); by default a lab over copies of notebooks/ and params/ under ``root``."""
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.root, self.shots = root, shots
        self.folder = "" if command else "notebooks/"
        shots.mkdir(parents=True, exist_ok=True)
        if not command:
            for folder in ("notebooks", "params"):
                shutil.copytree(REPO / folder, root / folder, dirs_exist_ok=True)
        # its own workspace (no tabs of an earlier test restored) and no news prompt over the page
        settings = root / "lab-settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True, exist_ok=True)
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        lab_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = open(shots / "jupyterlab.log", "wb")  # noqa: SIM115 (closed in close())
        base = (
            command(self.port)
            if command
            else [str(JUPYTER), "lab", "--no-browser", f"--ServerApp.root_dir={root}", "--ip=127.0.0.1",
                  f"--port={self.port}"]
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [*base, "--allow-root", f"--ServerApp.token={self.token}",
             "--LabApp.expose_app_in_browser=True", "--ServerApp.open_browser=False",
             f"--LabApp.workspaces_dir={root / 'lab-workspaces'}", f"--LabApp.user_settings_dir={root / 'lab-settings'}"],
            cwd=root, env=lab_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._wait_server()
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1900"):
            options.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.steps = 0

    def _wait_server(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {(self.shots / 'jupyterlab.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/api/status", params={"token": self.token}, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("jupyter lab did not answer in 90 s")

    # ------------------------------------------------------------ the page

    def js(self, script: str, *args: object) -> object:
        return self.driver.execute_script(script, *args)

    def open(self, notebook: str, timeout: float = 120) -> None:
        """Open a notebook and wait until its kernel is idle."""
        path = f"{self.folder}{notebook}"
        self.driver.get(f"{self.url}/lab/tree/{path}?token={self.token}")
        self.wait_for(
            lambda: self.js("return !!(window.jupyterapp && window.jupyterapp.shell);"), timeout, "JupyterLab"
        )
        # the workspace reopens earlier tabs too, and may activate one of them: make this one the current tab
        current = "const w = window.jupyterapp.shell.currentWidget; return w && w.context ? w.context.path : '';"

        def this_one() -> bool:
            if self.js(current) == path:
                return True
            self.js("window.jupyterapp.commands.execute('docmanager:open', {path: arguments[0]});", path)
            return False

        self.wait_for(this_one, timeout, f"{notebook} to be the current tab")
        self.wait_for(lambda: self.js(BUSY_JS) == "idle", timeout, f"{notebook}'s kernel to be idle")
        time.sleep(1)  # JupyterLab settles the document after the kernel's first reply

    def dirty(self) -> bool:
        return bool(self.js("return window.jupyterapp.shell.currentWidget.context.model.dirty;"))

    def command(self, name: str) -> None:
        self.js(f"window.jupyterapp.commands.execute('{name}');")

    def run_all(self, timeout: float) -> None:
        self.command("notebook:run-all-cells")
        self.wait_idle(timeout)

    def run_cell(self, index: int, timeout: float = 60) -> None:
        """Run one cell, as selecting it and pressing Shift+Enter's sibling (Ctrl+Enter) does."""
        self.js(f"window.jupyterapp.shell.currentWidget.content.activeCellIndex = {index};")
        self.command("notebook:run-cell")
        self.wait_idle(timeout)

    def cell_count(self) -> int:
        return int(self.js("return window.jupyterapp.shell.currentWidget.content.widgets.length;"))  # type: ignore[arg-type]

    def cell_text(self, index: int) -> str:
        return str(self.js(f"return window.jupyterapp.shell.currentWidget.content.widgets[{index}].node.innerText;"))

    def errors(self) -> list[str]:
        return list(
            self.js(
                "return [...document.querySelectorAll('.jp-RenderedText[data-mime-type=\"application/vnd.jupyter.stderr\"]')].map(e => e.innerText).filter(t => t.includes('Error'));"
            )
        )  # type: ignore[arg-type]

    def wait_idle(self, timeout: float) -> None:
        time.sleep(0.5)
        self.wait_for(lambda: self.js(BUSY_JS) == "idle", timeout, "the cells to finish")

    def wait_for(self, condition, timeout: float, what: str):  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.5)
        self.shot("timeout")
        raise TimeoutError(f"waited {timeout:.0f} s for {what}")

    def text_of(self, css: str) -> str:
        """The text of the first element matching ``css`` now ('' when none): widgets re-render their HTML on every
        change, so an element found earlier can be gone."""
        return str(self.js(f"const e = document.querySelector({css!r}); return e ? e.innerText : '';"))

    def find(self, css: str):  # noqa: ANN201
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def shot(self, name: str) -> Path:
        self.steps += 1
        path = self.shots / f"{self.steps:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def scroll_to(self, css: str) -> None:
        self.js(f"document.querySelector({css!r}).scrollIntoView({{block: 'center'}});")

    # ------------------------------------------------------------ the end

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            self.proc.send_signal(signal.SIGTERM)  # JupyterLab shuts its kernels down on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            self.log.close()
