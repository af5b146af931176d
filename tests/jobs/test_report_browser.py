"""The HTML report renders in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``scripts/test.sh`` installs) driven by selenium.

The report test loads a two-run report over ``file://`` and checks that the page loads,
that every image decodes to a non-zero size, and that the console has no errors; it keeps
a full-page screenshot in ``$LOWPREC_ARTIFACTS`` (default ``<repo>/test-artifacts/``).
A second test loads a deliberately broken page to show those checks do fail.

Without the browser, the driver or selenium the tests skip, unless
``LOWPREC_REQUIRE_BROWSER=1`` (CI sets it), where they fail.
"""

from __future__ import annotations

import base64
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from lowprec.jobs.report import write_report
from lowprec.jobs.train import TrainConfig, train

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1400, 1000)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A page of inline PNGs loads in well under a second; 60 s leaves room for a loaded CI host.
LOAD_TIMEOUT_S = 60


def _unavailable(reason: str) -> None:
    if os.environ.get("LOWPREC_REQUIRE_BROWSER") == "1":
        pytest.fail(f"LOWPREC_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def artifact_dir() -> Path:
    d = Path(os.environ.get("LOWPREC_ARTIFACTS") or ROOT / "test-artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        _unavailable(
            f"no {' or '.join(missing)} (apt-get install chromium chromium-driver, "
            "or run bash scripts/test.sh as root)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.selenium_manager import SeleniumManager
    except ImportError as e:
        _unavailable(f"selenium is not installed ({e}; pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Explicit binaries: Selenium Manager (which would download a browser/driver) never runs.
    no_manager = mock.patch.object(
        SeleniumManager,
        "binary_paths",
        side_effect=AssertionError("Selenium Manager must not run: binaries are explicit"),
    )
    with no_manager:
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


# ---- helpers (also checked against a broken page below) --------------------------------


def load(driver: Any, path: Path) -> None:
    """Open ``path`` over file:// (after draining older console entries) and wait for it."""
    driver.get_log("browser")
    driver.get(path.resolve().as_uri())
    # ``get`` normally returns once the load event fired, but chromedriver can hand back
    # control at "interactive" on a loaded machine (CI saw it with the large report page,
    # whose images are inline data URIs still decoding). Wait for "complete", bounded.
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, LOAD_TIMEOUT_S, poll_frequency=0.1).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def images(driver: Any) -> list[dict[str, Any]]:
    """Every <img>: alt, the start of its src, complete, naturalWidth, naturalHeight."""
    return list(
        driver.execute_script(
            "return Array.from(document.images).map(i => ({alt: i.alt, src: i.src.slice(0, 40), "
            "complete: i.complete, w: i.naturalWidth, h: i.naturalHeight}));"
        )
    )


def broken_images(driver: Any) -> list[dict[str, Any]]:
    """The images that did not load and decode to a non-zero natural size."""
    return [i for i in images(driver) if not (i["complete"] and i["w"] > 0 and i["h"] > 0)]


def severe_console(driver: Any) -> list[dict[str, Any]]:
    """SEVERE browser console entries since the last call (the log is drained)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def full_page_screenshot(driver: Any, out: Path) -> Path:
    """A PNG of the whole page, not just the window (CDP, beyond the viewport)."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        },
    )
    out.write_bytes(base64.b64decode(shot["data"]))
    return out


# ---- tests ---------------------------------------------------------------------------------


def test_report_renders_in_chromium(browser: Any, tmp_path: Path) -> None:
    cfg = TrainConfig(
        recipe="fp16",
        steps=6,
        batch_size=8,
        seq_len=32,
        width=32,
        depth=1,
        heads=2,
        eval_every=3,
        eval_batches=2,
    )
    runs = [tmp_path / "fp32", tmp_path / "fp16"]
    train(dataclasses.replace(cfg, recipe="fp32"), runs[0], progress=False)
    train(cfg, runs[1], progress=False)
    page = write_report(runs, tmp_path / "report.html", title="lowprec browser test")

    load(browser, page)
    assert browser.title == "lowprec browser test"
    assert browser.find_element("tag name", "h1").text == "lowprec browser test"
    imgs = images(browser)
    # One loss-curve figure, then per run: tensor scales at initialisation and at the end
    # (numerics.jsonl holds the first and the last step) and one exponent-histogram figure.
    assert len(imgs) == 1 + 3 * len(runs), [i["alt"] for i in imgs]
    assert all(i["src"].startswith("data:image/png;base64,") for i in imgs)
    assert broken_images(browser) == []
    assert severe_console(browser) == []

    shot = full_page_screenshot(browser, artifact_dir() / "report_screenshot.png")
    data = shot.read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    page_height = browser.execute_script("return document.documentElement.scrollHeight")
    # The whole page, not the 1400x1000 window (whose vertical scrollbar takes ~15 px).
    assert height == page_height > WINDOW[1], (width, height, page_height)
    assert WINDOW[0] - 30 <= width <= WINDOW[0], (width, height)


def test_checks_catch_a_broken_page(browser: Any, tmp_path: Path) -> None:
    """The helpers are not vacuous: a corrupt data URI and a missing file are both reported
    as broken images, and the missing file as a SEVERE console entry."""
    ok = base64.b64encode(
        bytes.fromhex(
            "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
            "1f15c4890000000d49444154789c63f8cfc0f01f0005000201ffa8b4"
            "8a0d0000000049454e44ae426082"
        )
    ).decode()
    page = tmp_path / "broken.html"
    page.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        "<title>broken</title></head><body>"
        f'<img alt="good" src="data:image/png;base64,{ok}">'
        '<img alt="corrupt" src="data:image/png;base64,AAAAnotapng">'
        '<img alt="missing" src="no-such-file.png">'
        "</body></html>"
    )
    load(browser, page)
    assert [i["alt"] for i in images(browser)] == ["good", "corrupt", "missing"]
    assert [i["alt"] for i in broken_images(browser)] == ["corrupt", "missing"]
    severe = severe_console(browser)
    assert any("no-such-file.png" in e["message"] for e in severe), severe
