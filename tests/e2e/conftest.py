"""One real platform per test session (it takes a minute to load two models), and a headless
Chromium for the chat page."""

from __future__ import annotations

import os

import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.e2e.platform import Platform, running_platform

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def platform(tmp_path_factory) -> Platform:
    with running_platform(tmp_path_factory.mktemp("platform")) as running:
        yield running


# Not session-wide: playwright's sync API holds an event loop that async tests could not run beside.
@pytest.fixture(scope="module")
def chromium() -> Browser:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"the chat page test needs Debian's chromium at {CHROMIUM}: "
                    "apt-get install -y chromium (never `playwright install`)", pytrace=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
