"""The chat page (GET /) in headless Chromium against the real platform: a key entered, a model
picked, a reply seen streaming in, the page reloaded, the conversation opened from the list with its
history, and a follow-up streamed into it."""

from __future__ import annotations

import time

from playwright.sync_api import Browser, Locator, Page, expect

from tests.e2e.platform import MODELS, Platform

SCREENSHOT = "/tmp/e2e_chat.png"
FIRST = "Write a long story about a dragon."
FOLLOW_UP = "Now tell me more about the dragon."


def test_chat_page_streams_and_resumes_after_reload(chromium: Browser, platform: Platform):
    model = MODELS[1]          # not the first in the list: the choice must reach the request
    page = chromium.new_page(viewport={"width": 1100, "height": 700})
    try:
        page.goto(f"{platform.gateway}/")
        page.fill("#api-key", platform.api_key)
        page.click("#save-key")
        expect(page.locator("#model option")).to_have_count(len(MODELS))
        page.select_option("#model", model)

        first_reply = send_and_watch(page, FIRST)
        conversation_id = page.evaluate("localStorage.getItem('llmserve.conversation')")
        assert conversation_id
        stored = wait_stored(platform, conversation_id, 2)
        assert stored["model"] == model and stored["messages"][0]["content"] == FIRST
        assert stored["messages"][1]["content"].startswith(first_reply)

        page.reload()
        page.click("#new-conversation")
        expect(page.locator(".message")).to_have_count(0)
        page.click(f"#conversations li[data-id='{conversation_id}']")
        messages = page.locator(".message")
        expect(messages).to_have_count(2)
        expect(messages.nth(0)).to_have_text(FIRST)
        expect(messages.nth(1)).to_have_text(stored["messages"][1]["content"])
        expect(page.locator("#conversations li.current")).to_have_attribute("data-id", conversation_id)
        expect(page.locator("#model")).to_have_value(model)

        follow_up_reply = send_and_watch(page, FOLLOW_UP)
        page.screenshot(path=SCREENSHOT, full_page=True)
        stored = wait_stored(platform, conversation_id, 4)
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "user", "assistant"]
        assert stored["messages"][2]["content"] == FOLLOW_UP
        assert stored["messages"][3]["content"].startswith(follow_up_reply)
        assert page.locator("#status").inner_text() == ""        # no error was shown
    finally:
        page.close()


def send_and_watch(page: Page, text: str, observations: int = 4, timeout_s: float = 120) -> str:
    """Sends `text`, sees the reply grow over several looks, stops it (replies are unbounded: the page
    asks for no max_tokens) and returns what the page showed."""
    page.fill("#prompt", text)
    page.click("#send")
    expect(page.locator(".message.user").last).to_have_text(text)
    reply = page.locator(".message.assistant").last
    seen = growth(page, reply, observations, timeout_s)
    assert len(seen) >= 3, f"the reply did not stream in pieces: {seen}"
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))
    if page.locator("#stop").is_enabled():
        page.click("#stop")
    expect(page.locator("#send")).to_be_enabled()
    return reply.text_content()


def growth(page: Page, reply: Locator, observations: int, timeout_s: float) -> list[str]:
    """The reply's text each time it was seen longer, until `observations` or the reply ended."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(seen) < observations:
        text = reply.text_content()
        if text and (not seen or len(text) > len(seen[-1])):
            seen.append(text)
        if page.locator("#send").is_enabled():      # the reply ended on its own
            break
        assert time.monotonic() < deadline, f"no {observations} observations of a growing reply: {seen}"
        page.wait_for_timeout(100)
    return seen


def wait_stored(platform: Platform, conversation_id: str, count: int, timeout_s: float = 30) -> dict:
    """The conversation once the gateway stored `count` messages (it stores a stopped reply after the
    client went away)."""
    deadline = time.monotonic() + timeout_s
    with platform.http() as http:
        while True:
            conversation = http.get(f"/v1/conversations/{conversation_id}").json()
            if conversation["message_count"] >= count:
                return conversation
            assert time.monotonic() < deadline, f"{count} messages not stored: {conversation}"
            time.sleep(0.2)
