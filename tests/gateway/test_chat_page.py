"""The chat page in headless Chromium: a key entered, a message sent, tokens seen arriving, a reply
stopped, and the conversation (with the stopped reply marked) resumed after a reload."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser import chromium
from tests.gateway.harness import GatewayHarness


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


def test_send_stream_stop_reload_resume(gateway: GatewayHarness, browser):
    _, _, key = gateway.new_org("browser")
    page = browser.new_page()
    page.goto(gateway.base_url + "/")
    page.fill("#api-key", key)
    page.click("#save-key")
    expect(page.locator("#model option[value='fake-model']")).to_have_count(1)
    page.select_option("#model", "fake-model")

    page.fill("#prompt", "[slow][words:30] hello")
    page.click("#send")
    reply = page.locator(".message.assistant").last
    expect(reply).to_contain_text("w2 ")
    assert "w29" not in reply.inner_text()            # seen mid-stream: tokens arrive one by one
    expect(reply).to_contain_text("w29 ")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#conversations li")).to_have_count(1)

    page.fill("#prompt", "[drip] go on")
    page.click("#send")
    expect(page.locator(".message.assistant").last).to_contain_text("d3 ")
    page.click("#stop")
    expect(page.locator(".message.assistant.partial")).to_have_count(1)
    gateway.drain()

    page.reload()
    messages = page.locator(".message")
    expect(messages).to_have_count(4)
    expect(messages.nth(0)).to_have_text("[slow][words:30] hello")
    expect(messages.nth(1)).to_contain_text("w29")
    expect(messages.nth(3)).to_have_class("message assistant partial")
    assert page.evaluate("localStorage.getItem('llmserve.apiKey')") == key

    page.fill("#prompt", "and now?")
    page.click("#send")
    expect(page.locator(".message.assistant").last).to_have_text("Hello there friend")
    history = [m.content for m in gateway.fake.calls[-1].request.chat.messages]
    assert history[0] == "[slow][words:30] hello" and history[2] == "[drip] go on" and history[-1] == "and now?"
    page.close()
