"""The e2e platform's ports: the browser must be able to visit the gateway wherever it lands."""

from __future__ import annotations

import random

from tests.browser import CHROMIUM_UNSAFE_PORTS
from tests.e2e import platform


def test_port_offset_never_puts_a_port_where_chromium_refuses_to_go(monkeypatch, tmp_path):
    # Offset 2000 puts the gateway on 10080 (net::ERR_UNSAFE_PORT in CI); it must be passed over.
    offsets = iter([20, 20, 31])
    monkeypatch.setattr(random, "randrange", lambda *_: next(offsets))
    monkeypatch.setattr(platform.LAUNCHER, "_port_free", lambda port: True)
    assert 10080 in {p for s in platform.LAUNCHER.plan({}, 2000, tmp_path) for p in s.ports}
    offset = platform._choose_port_offset(tmp_path)
    assert offset == 3100
    assert not CHROMIUM_UNSAFE_PORTS.intersection(p for s in platform.LAUNCHER.plan({}, offset, tmp_path)
                                                  for p in s.ports)
