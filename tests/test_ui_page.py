"""The UI's pages in a real browser (headless Chromium, as `.ci/run` installs it) over run folders written as the
trainer writes them, without training: quick enough for every run of the suite. tests/test_ui_browser.py (slow)
trains, stops and resumes real runs from the page."""

from __future__ import annotations

from .test_ui import fake_run
from .test_ui_browser import page, ui  # noqa: F401 - fixtures


def test_the_runs_a_run_and_compare_pages_draw_in_a_browser(ui, page):  # noqa: F811 - the fixtures
    root, address = ui
    fake_run(root / "alpha")
    fake_run(root / "beta", lr=2e-3, samples=(10, 20))

    page.goto(address)
    page.wait_for_selector('tr[data-run="alpha"] .status.finished')
    page.wait_for_selector('tr[data-run="beta"] .status.finished')

    page.click('tr[data-run="alpha"] a')
    page.wait_for_selector(".chart canvas")
    page.wait_for_function("[...document.images].some(i => i.complete && i.naturalWidth > 0)")
    assert "lora.safetensors" in page.inner_text("body")  # a checkpoint's files, each a download

    page.goto(address + "#/compare/alpha,beta")
    page.wait_for_selector(".chart canvas")
    legend = page.inner_text(".chart .u-legend")
    assert "alpha" in legend and "beta" in legend
    assert "optim.lr" in page.inner_text("body")  # where their configs differ
