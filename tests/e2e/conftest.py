"""One real platform per test session (it takes a minute to load two models), and a headless
Chromium for the chat page."""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser

from tests.browser import chromium as launch_chromium
from tests.e2e.platform import Platform, running_platform


@pytest.fixture(scope="session")
def platform(tmp_path_factory) -> Platform:
    with running_platform(tmp_path_factory.mktemp("platform")) as running:
        yield running


# Not session-wide: playwright's sync API holds an event loop that async tests could not run beside.
@pytest.fixture(scope="module")
def chromium() -> Browser:
    with launch_chromium() as browser:
        yield browser
