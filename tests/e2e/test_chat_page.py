"""The chat page (GET /) in headless Chromium against the real platform (`make run`: router, real
workers, conversations service): local mode fills in the development key, a model and generation
settings are chosen, a reply streams in as Markdown with its TTFT and tokens/s, the page is
reloaded and the conversation opened from the list with its history and settings, the answer
regenerated, and a follow-up streamed into it."""

from __future__ import annotations

import re
import time

from playwright.sync_api import Browser, Locator, Page, expect

from tests.e2e.platform import MODELS, Platform

SCREENSHOT = "/tmp/e2e_chat.png"
FIRST = "Write a long story about a dragon."
FOLLOW_UP = "Now tell me more about the dragon."
MAX_TOKENS = 64
STATS = re.compile(r"^TTFT \d+\.\d\d s · \d+\.\d tokens/s · \d+ tokens$")


def test_chat_page_streams_and_resumes_after_reload(chromium: Browser, platform: Platform):
    model = MODELS[1]          # not the first in the list: the choice must reach the request
    page = chromium.new_page(viewport={"width": 1100, "height": 700})
    try:
        page.goto(f"{platform.gateway}/")
        expect(page.locator("#api-key")).to_have_value(platform.api_key)   # local mode: the dev key
        expect(page.locator("#model option")).to_have_count(len(MODELS))
        expect(page.locator("#prompt")).to_be_focused()
        page.select_option("#model", model)
        page.click("#settings-toggle")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", str(MAX_TOKENS))

        first_reply = send_and_watch(page, FIRST)
        conversation_id = page.evaluate("localStorage.getItem('llmserve.conversation')")
        assert conversation_id
        stored = wait_stored(platform, conversation_id, 2)
        assert stored["model"] == model and stored["messages"][0]["content"] == FIRST
        assert stored["messages"][1]["content"] == first_reply
        assert stored["metadata"]["max_tokens"] == str(MAX_TOKENS) and stored["metadata"]["temperature"] == "0"
        expect(page.locator("#conversations li.current .open")).to_have_text(FIRST)
        shown = page.locator("article.message.assistant .body").inner_text()

        page.reload()
        page.click("#new-conversation")
        expect(page.locator("article.message")).to_have_count(0)
        expect(page.locator("#max-tokens")).to_have_value("512")          # a new chat starts from the defaults
        page.click(f"#conversations li[data-id='{conversation_id}'] .open")
        messages = page.locator("article.message")
        expect(messages).to_have_count(2)
        expect(messages.nth(0).locator(".body")).to_have_text(FIRST)
        expect(messages.nth(1).locator(".body")).to_have_text(shown, use_inner_text=True)   # as `shown` was read: paragraphs apart
        expect(page.locator("#conversations li.current")).to_have_attribute("data-id", conversation_id)
        expect(page.locator("#model")).to_have_value(model)
        expect(page.locator("#max-tokens")).to_have_value(str(MAX_TOKENS))

        old_answer = stored["messages"][1]["id"]
        page.locator("article.message.assistant .regenerate").click()
        expect(page.locator("article.message.assistant .stats")).to_have_text(STATS, timeout=120_000)
        stored = wait_stored(platform, conversation_id, 2)
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
        assert stored["messages"][1]["id"] != old_answer and stored["message_count"] == 2

        follow_up_reply = send_and_watch(page, FOLLOW_UP)
        page.screenshot(path=SCREENSHOT, full_page=True)
        stored = wait_stored(platform, conversation_id, 4)
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "user", "assistant"]
        assert stored["messages"][2]["content"] == FOLLOW_UP
        assert stored["messages"][3]["content"] == follow_up_reply
        assert page.locator("#status").inner_text() == ""        # no error was shown
    finally:
        page.close()


def send_and_watch(page: Page, text: str, observations: int = 4, timeout_s: float = 120) -> str:
    """Sends `text` with Enter, sees the reply grow over several looks and end on its own (at
    MAX_TOKENS at the latest) with its stats, and returns the stored form of what the page showed."""
    page.fill("#prompt", text)
    page.keyboard.press("Enter")
    expect(page.locator("article.message.user .body").last).to_have_text(text)
    reply = page.locator("article.message.assistant").last
    seen = growth(page, reply.locator(".body"), observations, timeout_s)
    assert len(seen) >= 3, f"the reply did not stream in pieces: {seen}"
    # Rendered Markdown may restyle a reply's last characters as more arrive (a list marker, `**`).
    assert all(later.startswith(earlier[:len(earlier) // 2]) for earlier, later in zip(seen, seen[1:]))
    expect(reply.locator(".stats")).to_have_text(STATS, timeout=timeout_s * 1000)
    tokens = int(re.search(r"(\d+) tokens$", reply.locator(".stats").inner_text()).group(1))
    assert 0 < tokens <= MAX_TOKENS
    expect(page.locator("#send")).to_be_enabled()
    return page.evaluate("document.querySelectorAll('article.message.assistant')"
                         "[document.querySelectorAll('article.message.assistant').length - 1].text")


def growth(page: Page, body: Locator, observations: int, timeout_s: float) -> list[str]:
    """The reply's text each time it was seen longer, until `observations` or the reply ended."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(seen) < observations:
        text = body.text_content()
        if text and (not seen or len(text) > len(seen[-1])):
            seen.append(text)
        if page.locator("#send").is_visible():      # the reply ended on its own
            break
        assert time.monotonic() < deadline, f"no {observations} observations of a growing reply: {seen}"
        page.wait_for_timeout(100)
    return seen


def wait_stored(platform: Platform, conversation_id: str, count: int, timeout_s: float = 30) -> dict:
    """The conversation once the gateway stored `count` messages."""
    deadline = time.monotonic() + timeout_s
    with platform.http() as http:
        while True:
            conversation = http.get(f"/v1/conversations/{conversation_id}").json()
            if conversation["message_count"] >= count:
                return conversation
            assert time.monotonic() < deadline, f"{count} messages not stored: {conversation}"
            time.sleep(0.2)
