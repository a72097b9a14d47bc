"""A headless Chromium driven by selenium, against real `gouache serve` processes. Skipped where
Debian's chromium and chromium-driver are not installed (`make test` installs them where it can)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import gouache
from tests.api.helpers import running_server

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "ui"
API_KEY = "playground-test-key"
# What Chromium needs on a closed network, as root, with no screen.
_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
          "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--window-size=1280,1000")


@pytest.fixture(scope="package")
def browser(tmp_path_factory):
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver on PATH (Debian packages chromium, chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # given, so that selenium never tries to download one
    for flag in _FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.fixture(scope="package")
def server():
    """shapes-unet with its trained adapters: the `palette` LoRA and the `layout` ControlNet."""
    weights = Path(gouache.__file__).parent / "weights"
    with running_server("--model", "shapes-unet", "--lora-dir", str(weights / "loras" / "shapes-unet"),
                        "--controlnet-dir", str(weights / "controlnets" / "shapes-unet")) as url:
        yield url


@pytest.fixture(scope="package")
def replicas_server():
    with running_server("--model", "shapes-unet", "--replicas", "2") as url:
        yield url


@pytest.fixture(scope="package")
def key_server():
    with running_server("--model", "shapes-unet", "--api-key", API_KEY) as url:
        yield url


@pytest.fixture
def screenshot(browser):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(name: str) -> None:
        assert browser.save_screenshot(str(SCREENSHOTS / f"{name}.png"))

    return take
