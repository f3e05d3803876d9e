"""Debian's headless Chromium, driven by playwright (never a downloaded browser build)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialling out of this closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium() -> Iterator[Browser]:
    """Fails the test (never skips) when Chromium is missing: `make browser` installs it."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"the chat page tests need Debian's chromium at {CHROMIUM}: "
                    "make browser (apt-get install -y chromium; never `playwright install`)", pytrace=False)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
