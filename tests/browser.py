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
# Chromium refuses to load pages from these ports (net::ERR_UNSAFE_PORT; net/base/port_util.cc's
# restricted list above 1023), so a platform the browser visits must not listen on one.
CHROMIUM_UNSAFE_PORTS = frozenset({1719, 1720, 1723, 2049, 3659, 4045, 4190, 5060, 5061, 6000, 6566,
                                   *range(6665, 6670), 6679, 6697, 10080})


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
