"""Fixtures for the browser tests: a headless Chromium and a JupyterLab server on localhost.

Chromium is Debian's (``apt-get install chromium``), driven by the Python ``playwright``
package (``playwright install`` is never needed). Without either, every browser test is
skipped with the reason, which ``-ra`` prints. ``WORKBENCH_CHROMIUM`` overrides the path of
the executable (``WORKBENCH_CHROMIUM=/nonexistent`` shows the skip).

The server runs on a copy of notebooks/ in a temporary directory, so that autosave never
touches the committed notebooks, with ``WORKBENCH_FAST=1`` and the repository root first on
``PYTHONPATH`` (the kernels inherit both), and with its own empty Jupyter config, settings and
workspace directories, so that nothing of the user's JupyterLab state leaks into the test.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TOKEN = "workbench-browser-test"
SERVER_START_TIMEOUT = 90  # seconds until the server answers /api/status

# User settings for the test server: every cell in the DOM (no windowing, so that the widgets
# of cells out of view are rendered too), no news or update checks (no network).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


@pytest.fixture(scope="session")
def browser():
    """A headless Chromium, or a skip that says what is missing and how to install it."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright not installed: pip install playwright "
                    "(it is in the dev extra: pip install -e '.[dev]')")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"chromium not found at {CHROMIUM}: install it with "
                    "apt-get install chromium (.ci/run does)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it and its kernels), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def lab(browser, tmp_path_factory):
    """A JupyterLab server on a copy of notebooks/: ``{"url", "token", "root", "log"}``.

    Requests ``browser`` first so that a missing Chromium skips before a server is started.
    """
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    shutil.copytree(ROOT / "notebooks", root,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    settings = base / "settings"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    env = {**os.environ,
           "WORKBENCH_FAST": "1",
           "WORKBENCH_SOLUTIONS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, paths)]),
           "JUPYTER_CONFIG_DIR": str(base / "config"),
           "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
           "MPLBACKEND": "Agg"}
    port = _free_port()
    jupyter = Path(sys.executable).parent / "jupyter"
    command = [str(jupyter) if jupyter.exists() else "jupyter", "lab",
               "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
               "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}",
               f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
               *(["--allow-root"] if os.getuid() == 0 else [])]
    log_path = base / "jupyter-lab.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while not _answers(f"{url}/api/status?token={TOKEN}"):
            if process.poll() is not None or time.monotonic() > deadline:
                state = (f"exited with {process.returncode}" if process.poll() is not None
                         else f"no answer in {SERVER_START_TIMEOUT} s")
                pytest.fail(f"jupyter lab {state}; its log ({log_path}):\n"
                            f"{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.25)
        yield {"url": url, "token": TOKEN, "root": root, "log": log_path}
    finally:
        _stop(process)
