"""What `make run` shows a newcomer: every service's address, the chat page's URL with the dev key,
and a curl example; and the chat page is really there."""

from __future__ import annotations

from tests.e2e.platform import MODELS, Platform


def test_launcher_announces_every_address_and_the_chat_page(platform: Platform):
    printed = platform.launcher_output.read_text()
    summary = printed[printed.index("llmserve is running:"):]
    for name, address in platform.addresses.items():
        assert any(line.split()[:2] == [name, address] for line in summary.splitlines() if line.strip()), name
    assert f"Chat page:  {platform.gateway}/   (API key {platform.api_key})" in summary
    assert f"curl {platform.gateway}/v1/chat/completions -H 'Authorization: Bearer {platform.api_key}'" in summary
    assert f'"model": "{MODELS[0]}"' in summary

    with platform.http() as http:
        page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/chat.js" in page.text
