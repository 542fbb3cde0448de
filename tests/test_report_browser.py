"""The HTML report opened in a real browser (Debian chromium driven by Playwright), offline.

Skipped with a reason where chromium or Playwright is missing; `.ci/run` installs chromium and sets
SLM_BENCH_REQUIRE_BROWSER=1, so in CI a missing browser is a failure, not a skip.
"""
import os
import shutil
from pathlib import Path

import pytest

from conftest import PIPELINES

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _browser_or_skip():
    reason = None
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        reason = "playwright is not installed (pip install -e '.[dev]')"
    if CHROMIUM is None:
        reason = "chromium is not installed (apt-get install chromium; .ci/run does this)"
    if reason:
        if os.environ.get("SLM_BENCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required in CI but {reason}")
        pytest.skip(reason)


@pytest.fixture
def page():
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        external = []
        # Offline proof: every request that is not a local file is recorded and refused.
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                   else (external.append(route.request.url), route.abort()))
        page.external_requests = external
        yield page
        browser.close()


def test_report_index_and_stage_pages_in_chromium(cli, tmp_path, page):
    run_dir, reports = tmp_path / "browsed", tmp_path / "reports"
    result = cli("run", "--pipeline", PIPELINES / "basic", "--run-dir", run_dir, "--report-dir", reports)
    assert result.returncode == 0, result
    failing = cli("run", "--pipeline", PIPELINES / "failing", "--run-dir", tmp_path / "broken", "--report-dir", reports)
    assert failing.returncode == 1

    index = reports / "browsed" / "index.html"
    page.goto(index.as_uri())
    rows = page.locator("tr.stage")
    assert rows.count() == 2
    assert rows.nth(0).locator("td.recipe").inner_text() == "basic"
    assert rows.nth(0).locator("td").nth(2).inner_text().startswith("source")
    assert [rows.nth(i).locator("td").nth(3).inner_text() for i in range(2)] == ["ok", "ok"]
    assert "total = 6" in rows.nth(1).inner_text()
    results = page.locator("h2.results + style + table.slm-bench")  # the stage's BenchmarkTable, below the stages
    assert page.locator("h2.results").inner_text() == "double/results"
    assert results.locator("tr.ours td").all_inner_texts() == ["doubled", "6"]
    shot = tmp_path / "index.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 5_000
    shutil.copy(shot, reports / "browsed" / "index.png")  # kept beside the report for a human to look at

    page.click("text=double")
    page.wait_for_load_state("load")
    assert page.url.endswith("/double.html")
    assert page.locator("nav.slm-nav").inner_text().startswith("← run browsed")
    figure = page.locator("img[src^='data:image/png']")
    assert figure.count() >= 1 and figure.first.evaluate("img => img.naturalWidth") > 100
    assert page.locator("details.slm-code").count() >= 3  # inputs collapsed, not lost
    if (reports / "browsed" / "_static" / "require.js").exists():  # offline widget snapshot (make setup installs the JS)
        page.wait_for_selector(".widget-slider", timeout=15_000)
        assert "factor" in page.locator(".widget-slider").first.inner_text()
    table = page.locator("table.slm-bench")  # the static table, not a widget with no kernel behind it
    assert table.locator("tr.ours td").all_inner_texts() == ["doubled", "6"]
    page.screenshot(path=str(reports / "browsed" / "double.png"), full_page=True)

    page.goto((reports / "broken" / "index.html").as_uri())
    broken = page.locator("tr.stage[data-stage='boom']")
    assert broken.locator("td").nth(3).inner_text() == "failed"
    assert "ValueError: planted failure" in broken.inner_text()
    assert page.external_requests == [], f"the report asked the network for {page.external_requests}"
