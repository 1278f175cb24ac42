"""The HTML report as a person sees it: a real run's report opened in headless Chromium (the Debian
package, driven by playwright with `executable_path`; playwright's own browser download is not
used). Curves and trajectories must render, with no console error; a screenshot is saved to
tmp_path, and also to `$ART_REPORT_SCREENSHOT` when set.

Without Chromium (or playwright) the test skips, unless `ART_REQUIRE_BROWSER=1` (set by .ci/run,
which installs Chromium), where it fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from art_core.app.report import CURVES, write_report
from art_core.storage import ModelStorage
from tests.helpers_runs import MODEL, PROJECT, build_run, explanation

ASYNC = pytest.mark.asyncio(loop_scope="function")


def _chromium() -> tuple[Any, str]:
    """playwright's async API and the system Chromium, or a skip (a failure under ART_REQUIRE_BROWSER=1)."""
    required = os.environ.get("ART_REQUIRE_BROWSER") == "1"
    path = os.environ.get("ART_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright import async_api
    except ImportError:
        async_api, missing = None, "playwright is not installed (pip install -e '.[dev]')"
    else:
        missing = "" if path else "no chromium on PATH (apt-get install -y chromium, or set ART_CHROMIUM)"
    if missing:
        if required:
            pytest.fail(f"ART_REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    assert path is not None
    return async_api, path


@ASYNC
async def test_the_report_renders_its_curves_and_trajectories_in_chromium_without_errors(
    tmp_path: Path,
) -> None:
    async_api, chromium = _chromium()
    run = await build_run(tmp_path / "art")
    storage = ModelStorage.create(run.root, PROJECT, MODEL)
    report = write_report(storage, f"art report: {PROJECT}/{MODEL}", tmp_path / "report.html")
    shot = tmp_path / "report.png"

    problems: list[str] = []
    async with async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("requestfailed", lambda request: problems.append(f"request failed: {request.url}"))
            await page.goto(report.as_uri())
            await page.wait_for_load_state("load")
            charts = await page.locator("svg").count()
            points = await page.locator("svg polyline.series").evaluate_all(
                "nodes => nodes.map(n => n.getAttribute('points').split(' ').length)"
            )
            drawn = await page.locator("svg polyline.series").evaluate_all(
                "nodes => nodes.map(n => n.getBoundingClientRect().width)"
            )
            titles = await page.locator("svg").evaluate_all("nodes => nodes.map(n => n.textContent)")
            trajectories = page.locator(".trajectory")
            count = await trajectories.count()
            visible = [await trajectories.nth(i).is_visible() for i in range(count)]
            box = await page.locator("svg").first.bounding_box()
            body = await page.inner_text("body")
            await page.screenshot(path=str(shot), full_page=True)
        finally:
            await browser.close()

    if target := os.environ.get("ART_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, target)
    assert problems == []
    assert charts == len(CURVES)
    assert len(points) == len(CURVES)  # every curve has data in this run
    multi = [w for n, w in zip(points, drawn, strict=True) if n >= 2]
    assert len(multi) == 5 and all(w > 100 for w in multi)  # the train curves span steps 1-2
    assert any("reward (train)" in t for t in titles) and any("grad norm" in t for t in titles)
    assert box is not None and box["width"] > 200 and box["height"] > 100
    assert count >= 4 and all(visible)
    assert "<b>task" in body and explanation("0").split(" ")[0] in body  # escaped text, shown as text
    assert shot.stat().st_size > 10_000
