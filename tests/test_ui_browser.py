"""`sdtrain ui` in a real browser over real tiny runs: one the CLI trained, one started, stopped and resumed from
the page, which ends bitwise as the uninterrupted one; then the two compared. With SDTRAIN_UI_SCREENSHOTS=FOLDER
each page's screenshot is saved there (docs/images/ui-*.png, which docs/ui.md shows, are made so)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import same_checkpoints

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("starlette")

CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = os.environ.get("SDTRAIN_UI_SCREENSHOTS")
STEPS = 60


@pytest.fixture
def ui(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    # Port 0: the UI takes a free port and prints its address once it listens, so the first line is the cue.
    server = subprocess.Popen([sys.executable, "-m", "sdtrain", "ui", str(root), "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        first = server.stdout.readline()
        address = re.search(r"at (http://\S+/)", first)
        assert address, f"the UI printed no address: {first!r}"
        yield root, address.group(1)
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
        # A first start compiles the UI's and its children's imports while the page waits: minutes on a cold machine.
        page.set_default_timeout(180_000)
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
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / f"ui-{name}.png"), full_page=True)


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
    # The run's data as training receives it: `sdtrain data preview` of its config, shown in the page.
    page.click("#preview-data")
    page.wait_for_function("document.getElementById('preview-error') || (document.getElementById('preview') && "
                           "document.getElementById('preview').complete && "
                           "document.getElementById('preview').naturalWidth > 0)", timeout=120_000)
    assert page.query_selector("#preview-error") is None, page.inner_text("#preview-result")

    # The short form fills a recipe and its overrides; a key typed wrong is flagged under the editor, and the key
    # under the cursor is explained.
    page.goto(address + "#/start")
    page.wait_for_selector("#f-family option[value=sdxl]", state="attached", timeout=180_000)
    page.select_option("#f-family", "sdxl")
    page.fill("#f-pretrained", "stabilityai/stable-diffusion-xl-base-1.0")
    page.fill("#f-data", str(root))
    page.fill("#f-steps", "300")
    page.click("#fill")
    page.wait_for_function("document.getElementById('overrides').value.includes('train.max_steps=300')")
    assert page.input_value("#source") == "sdxl-lora" and "model.family=sdxl" in page.input_value("#overrides")
    page.wait_for_selector("#key-problems .ok")
    page.fill("#config", page.input_value("#config").replace("  resolution: 1024", "  resolutio: 1024"))
    page.wait_for_selector("#key-problems li[data-key='data.resolutio']")
    assert "Did you mean: 'resolution'" in page.inner_text("#key-problems")
    page.focus("#f-steps")
    page.wait_for_function("document.getElementById('key-help').textContent.includes('train.max_steps')")
    _shot(page, "start-form")

    # The second run from the page: the same config and overrides, its folder named by the form.
    config, overrides = Path(command[1]).read_text(), [a for a in command[2:] if not a.startswith("run_dir=")]
    page.goto(address + "#/start")
    page.wait_for_selector("textarea#config")  # the same page, drawn anew for its new address
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
    final = f"checkpoints/step_{STEPS:08d}"
    same_checkpoints(root / "cli-run" / final, root / "ui-run" / final)  # stopped and resumed: nothing differs

    page.goto(address + "#/compare/cli-run,ui-run")
    page.wait_for_selector(".chart canvas")
    legend = page.inner_text(".chart .u-legend")
    assert "cli-run" in legend and "ui-run" in legend
    page.wait_for_function("document.querySelectorAll('.images img').length === 2")
    _shot(page, "compare")
