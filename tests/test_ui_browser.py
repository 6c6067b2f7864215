"""`sdtrain ui` in a real browser over real tiny runs: one the CLI trained, one started, stopped and resumed from
the page; then the two compared. Saves each page's screenshot as docs/images/ui-*.png (docs/ui.md shows them)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("starlette")

CHROMIUM = "/usr/bin/chromium"
IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
STEPS = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                json.load(response)
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url}: the UI did not answer")


@pytest.fixture
def ui(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "sdtrain", "ui", str(root), "--port", str(port)])
    try:
        _wait_for_server(f"http://127.0.0.1:{port}/api/runs")
        yield root, f"http://127.0.0.1:{port}/"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def page():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("dialog", lambda dialog: dialog.accept())
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        yield page
        browser.close()
        assert errors == []


def _status(page, wanted: str, seconds: float = 300) -> None:
    page.wait_for_function(f"document.getElementById('status') && "
                           f"document.getElementById('status').textContent === '{wanted}'", timeout=seconds * 1000)


def _shot(page, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMAGES / f"ui-{name}.png"), full_page=True)


def test_runs_started_by_the_cli_and_the_page(ui, page, tiny_scratch_command):
    from sdtrain.cli.main import main

    root, address = ui
    extra = ["logging.every=2", "checkpoint.every=10", "validation.prompts=[a red circle,a blue square]",
             "validation.steps=2"]
    command = tiny_scratch_command("sd", root / "cli-run", STEPS, *extra)
    assert main(command) == 0

    page.goto(address)
    page.wait_for_selector('tr[data-run="cli-run"] .status.finished')
    _shot(page, "runs")

    page.click('tr[data-run="cli-run"] a')
    page.wait_for_selector(".chart canvas")
    page.wait_for_function("[...document.images].some(i => i.complete && i.naturalWidth > 0)")
    _shot(page, "run")

    # The second run from the page: the same config and overrides, its folder named by the form.
    config, overrides = Path(command[1]).read_text(), [a for a in command[2:] if not a.startswith("run_dir=")]
    page.goto(address + "#/start")
    page.fill("#config", config)
    page.fill("#name", "ui-run")
    page.fill("#overrides", "\n".join([*overrides, "logging.every=1"]))
    page.click('button:text-is("Check")')
    page.wait_for_selector("#result .ok", timeout=120_000)
    _shot(page, "start")
    page.click("button.primary")
    page.wait_for_url("**/#/run/ui-run", timeout=120_000)
    page.wait_for_function("Number((document.getElementById('facts') || {}).textContent?.match(/step (\\d+)/)?.[1]) "
                           ">= 3", timeout=300_000)
    page.click('button:text-is("Stop")')
    _status(page, "stopped")
    stopped_at = json.loads((root / "ui-run" / "events.jsonl").read_text().splitlines()[-1])
    assert stopped_at["event"] == "stop" and stopped_at["step"] < STEPS
    page.click('button:text-is("Resume")')
    _status(page, "finished", seconds=600)

    page.goto(address + "#/compare/cli-run,ui-run")
    page.wait_for_selector(".chart canvas")
    legend = page.inner_text(".chart .u-legend")
    assert "cli-run" in legend and "ui-run" in legend
    page.wait_for_function("document.querySelectorAll('.images img').length === 2")
    _shot(page, "compare")
