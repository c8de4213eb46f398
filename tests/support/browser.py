"""A headless Chromium driven by Selenium, for the tests that use a page as a person would.

Chromium and its driver are Debian's (``chromium``, ``chromium-driver``;
``.ci/run`` installs them). Without them :func:`browser` skips the test with
the reason, or fails it under ``EXACTONCE_REQUIRE_SERVICES`` (CI), as a test
without its server does.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests import services

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@contextmanager
def browser(page_load_timeout: float = 30.0) -> Iterator[Any]:
    """A headless Chromium (Selenium's ``webdriver.Chrome``), quit at the end."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = (
            "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
        )
        if services.required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(page_load_timeout)
    driver.implicitly_wait(10)  # an element is looked for until the page that has it is there
    try:
        yield driver
    finally:
        driver.quit()


def arrived(driver: Any, part: str, timeout: float = 15.0) -> None:
    """Wait until the browser shows a loaded page whose URL has ``part`` (a click navigated)."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: part in d.current_url)
    WebDriverWait(driver, timeout).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )
