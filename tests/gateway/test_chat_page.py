"""The chat page in headless Chromium against the real gateway over the scripted fake upstream:
the page's own behaviour, checked on what the browser shows and on what reached the upstream.

Keyboard (Enter sends, Shift+Enter does not, Escape stops, Enter in the key field), Markdown while
streaming (list, table, highlighted code with label and copy; blocks not re-created; the reader's
scroll position kept), sanitising (nothing executes), settings sent and kept with the conversation,
regenerate and edit-and-resend replacing what the store holds, rename and delete across a reload,
readable errors (429 with its countdown, context too long, a model unavailable), the phone-sized
layout, themes, and the development key only in local mode.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from llmserve.v1 import conversations_pb2 as pb
from services.gateway.config import LocalModeConfig, UpstreamConfig
from tests.browser import chromium
from tests.gateway.harness import GatewayHarness, gateway_config

WEB = Path(__file__).resolve().parents[2] / "services" / "gateway" / "web"
STATIC = WEB.parent / "static"
# A stored assistant message with everything the renderer must handle, and what must never run.
MARKDOWN = """Here is what you asked for:

- alpha item
- beta item

| name | value |
|------|-------|
| x    | 1     |

```python
def add(x):
    return x + 1
```

<script>window.__pwned = "script"</script>

Inline <img src="nowhere.png" onerror="window.__pwned = 'img'"> too.

[click me](javascript:window.__pwned='link') and [a real link](https://example.com/docs)
"""


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture
def page(browser: Browser):
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    errors: list[str] = []

    def offline(route) -> None:      # the page works offline: nothing is fetched from elsewhere
        if route.request.url.startswith("http://127.0.0.1:"):
            route.continue_()
        else:
            errors.append(f"fetched from outside: {route.request.url}")
            route.abort()
    context.route("**/*", offline)
    page = context.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.confirms = []       # confirm() dialogs a test expects (accepted); any other dialog fails the test

    def dialog(d) -> None:
        if d.type == "confirm" and page.confirms:
            page.confirms.pop(0)
            d.accept()
        else:
            errors.append(f"unexpected dialog: {d.message}")
            d.dismiss()
    page.on("dialog", dialog)
    yield page
    context.close()
    assert not errors, errors


def test_committed_build_matches_its_source():
    """static/ is the build of web/ (CI has no Node): the hash the build wrote is the sources' hash."""
    paths = ["index.html", "package-lock.json", "vite.config.js"] + sorted(f"src/{p.name}" for p in (WEB / "src").iterdir())
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path}\n".encode() + (WEB / path).read_bytes() + b"\n")
    built = (STATIC / "source.sha256").read_text().strip()
    assert built == digest.hexdigest(), "services/gateway/static is stale: cd services/gateway/web && npm ci && npm run build"


def use_key(page: Page, gateway: GatewayHarness, key: str) -> None:
    page.goto(gateway.base_url + "/")
    expect(page.locator("#api-key")).to_be_focused()       # no key yet: the key field has focus
    page.fill("#api-key", key)
    page.press("#api-key", "Enter")                          # Enter uses the key
    expect(page.locator("#model option[value='fake-model']")).to_have_count(1)
    expect(page.locator("#prompt")).to_be_focused()
    page.select_option("#model", "fake-model")


def stored(gateway: GatewayHarness, key: str, conversation_id: str) -> dict:
    gateway.drain()
    reply = gateway.http.get(f"/v1/conversations/{conversation_id}", headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_until(page: Page, condition, timeout_s: float = 15) -> None:
    """Waits inside playwright, so that the page's requests (routed through this process) go on."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        page.wait_for_timeout(50)


def current_id(page: Page) -> str:
    return page.evaluate("localStorage.getItem('llmserve.conversation')")


def conversation_with(gateway: GatewayHarness, org_id: str, title: str, *turns: tuple[str, str]) -> str:
    """A conversation stored directly in the conversations service (model-independent content)."""
    async def make() -> str:
        conversation = await gateway.gateway.conversations.create(org_id, title, "fake-model", {})
        await gateway.gateway.conversations.append(org_id, conversation.id, [
            pb.NewMessage(role=role, content=content) for role, content in turns], "fixture")
        return conversation.id
    return gateway.call(make())


def test_keyboard_streaming_stop_and_resume(gateway: GatewayHarness, page: Page):
    _, _, key = gateway.new_org("keyboard")
    use_key(page, gateway, key)
    calls = len(gateway.fake.calls)
    # What a screen reader finds: named controls and regions.
    for role, name in (("textbox", "Message"), ("button", "Send"), ("combobox", "Model"), ("log", "Messages"),
                       ("navigation", "Conversation list"), ("complementary", "Conversations"),
                       ("textbox", "API key"), ("button", "New chat"), ("button", "Settings")):
        expect(page.get_by_role(role, name=name, exact=True)).to_have_count(1)

    page.locator("#prompt").type("[slow][words:30] first line")
    page.keyboard.press("Shift+Enter")                       # a new line, not a send
    page.keyboard.type("second line")
    expect(page.locator("#prompt")).to_have_value("[slow][words:30] first line\nsecond line")
    assert page.locator("article.message").count() == 0 and len(gateway.fake.calls) == calls
    page.keyboard.press("Enter")
    expect(page.locator("#prompt")).to_have_value("")
    expect(page.locator("article.message.user .body")).to_have_text("[slow][words:30] first line\nsecond line")

    reply = page.locator("article.message.assistant").last
    expect(reply.locator(".body")).to_contain_text("w2")
    assert "w29" not in reply.locator(".body").inner_text()    # seen mid-stream
    expect(reply.locator(".body")).to_contain_text("w29")
    expect(reply.locator(".stats")).to_have_text(re.compile(r"^TTFT \d+\.\d\d s · \d+(\.\d)? tokens/s · 30 tokens$"))
    expect(page.locator("#prompt")).to_be_focused()
    expect(reply).to_have_attribute("aria-busy", "false")
    expect(page.get_by_role("button", name="Regenerate this answer")).to_have_count(1)

    # The title comes from the first message; the new conversation is listed and marked current.
    conversation_id = current_id(page)
    current = page.locator("#conversations li.current")
    expect(current).to_have_attribute("data-id", conversation_id)
    expect(current.locator(".open")).to_have_text("[slow][words:30] first line")
    expect(current.locator(".open")).to_have_attribute("aria-current", "page")

    page.locator("#prompt").fill("[drip] go on")
    page.keyboard.press("Enter")
    expect(page.locator("article.message.assistant").last.locator(".body")).to_contain_text("d3")
    page.keyboard.press("Escape")                            # Escape stops
    stopped = page.locator("article.message.assistant").last
    expect(stopped).to_have_class(re.compile(r"\bpartial\b"))
    expect(stopped.locator(".stopped")).to_be_visible()
    expect(page.locator("#send")).to_be_visible()
    assert stored(gateway, key, conversation_id)["messages"][3]["partial"]

    page.reload()                                            # resuming shows the whole history
    articles = page.locator("article.message")
    expect(articles).to_have_count(4)
    expect(articles.nth(0).locator(".body")).to_have_text("[slow][words:30] first line\nsecond line")
    expect(articles.nth(1).locator(".body")).to_contain_text("w29")
    expect(articles.nth(3)).to_have_class(re.compile(r"\bpartial\b"))
    expect(page.locator("#prompt")).to_be_focused()


def test_markdown_code_and_sanitising(gateway: GatewayHarness, page: Page):
    org_id, _, key = gateway.new_org("markdown")
    conversation_id = conversation_with(gateway, org_id, "Markdown", ("user", "show me"), ("assistant", MARKDOWN))
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    use_key(page, gateway, key)
    page.click(f"#conversations li[data-id='{conversation_id}'] .open")

    body = page.locator("article.message.assistant .body")
    expect(body.locator("ul > li")).to_have_count(2)
    expect(body.locator("table td").first).to_have_text("x")
    expect(body.locator("table th").first).to_have_text("name")
    block = body.locator("figure.code-block")
    expect(block.locator(".code-language")).to_have_text("python")
    expect(block.locator("code .hljs-keyword").first).to_have_text("def")
    block.locator(".copy-code").click()
    expect(block.locator(".copy-code")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "def add(x):\n    return x + 1\n"

    # Raw HTML is text; the javascript: link lost its target; nothing ran, even when clicked.
    expect(body).to_contain_text('<script>window.__pwned = "script"</script>')
    assert body.locator("script, img, [onerror]").count() == 0
    expect(body.locator("a", has_text="click me")).not_to_have_attribute("href", re.compile("javascript", re.I))
    body.locator("a", has_text="click me").click()
    real = body.locator("a", has_text="a real link")
    expect(real).to_have_attribute("href", "https://example.com/docs")
    expect(real).to_have_attribute("rel", "noopener noreferrer")
    page.wait_for_timeout(200)
    assert page.evaluate("window.__pwned") is None

    # Streamed Markdown renders as it arrives, and a finished block keeps its node (no flicker).
    page.locator("#prompt").fill("[slow][say:- one\n- two\n\nA paragraph that keeps growing for a while "
                                 "so the stream is seen mid-way.\n\n```js\nlet a = 1;\n```\n]")
    page.keyboard.press("Enter")
    streamed = page.locator("article.message.assistant").last.locator(".body")
    expect(streamed.locator("ul > li")).to_have_count(2)
    expect(streamed.locator("p")).to_contain_text("A paragraph")      # the list is finished, the stream goes on
    assert "```" not in streamed.inner_text() and streamed.locator("figure").count() == 0
    page.evaluate("document.querySelectorAll('article.message.assistant')[1].querySelector('.body ul').marked = 1")
    expect(streamed.locator("figure.code-block .code-language")).to_have_text("js")
    expect(page.locator("#send")).to_be_visible()
    assert page.evaluate("document.querySelectorAll('article.message.assistant')[1].querySelector('.body ul').marked") == 1
    expect(streamed.locator("code .hljs-keyword")).to_have_text("let")


def test_scroll_position_is_kept_while_streaming(gateway: GatewayHarness, page: Page):
    org_id, _, key = gateway.new_org("scroll")
    conversation_id = conversation_with(gateway, org_id, "Long", *[("user", "more"), ("assistant", MARKDOWN)] * 4)
    page.set_viewport_size({"width": 1000, "height": 500})
    use_key(page, gateway, key)
    page.click(f"#conversations li[data-id='{conversation_id}'] .open")
    box = page.locator("#messages")
    page.locator("#prompt").fill("[drip] keep going")
    page.keyboard.press("Enter")
    reply = page.locator("article.message.assistant").last.locator(".body")
    expect(reply).to_contain_text("d5")
    at_bottom = "(() => { const b = document.getElementById('messages'); return b.scrollHeight - b.scrollTop - b.clientHeight; })()"
    assert page.evaluate(at_bottom) < 48                     # following the reply while the reader is there
    box.evaluate("b => b.scrollTop = 100")                   # the reader scrolls up
    length = len(reply.inner_text())
    page.wait_for_timeout(600)
    assert len(reply.inner_text()) > length                  # the reply kept growing
    assert box.evaluate("b => b.scrollTop") == 100           # and the reader stayed where they were
    page.click("#stop")
    expect(page.locator("article.message.assistant.partial")).to_have_count(1)


def test_settings_are_sent_and_kept_regenerate_and_edit(gateway: GatewayHarness, page: Page):
    _, _, key = gateway.new_org("settings")
    use_key(page, gateway, key)
    page.click("#settings-toggle")
    page.fill("#temperature", "0.3")
    page.fill("#max-tokens", "40")
    page.fill("#system-prompt", "Be brief.")
    page.locator("#prompt").fill("[words:5] hi")
    page.keyboard.press("Enter")
    expect(page.locator("article.message.assistant .body")).to_have_text("w0 w1 w2 w3 w4")
    sent = gateway.fake.calls[-1].request
    assert sent.sampling.temperature == pytest.approx(0.3) and sent.sampling.max_tokens == 40
    assert [(m.role, m.content) for m in sent.chat.messages] == [("system", "Be brief."), ("user", "[words:5] hi")]
    conversation_id = current_id(page)
    kept = stored(gateway, key, conversation_id)
    assert kept["metadata"] == {"temperature": "0.3", "max_tokens": "40", "system_prompt": "Be brief."}
    assert kept["model"] == "fake-model"

    page.fill("#temperature", "1.2")
    page.locator("#temperature").dispatch_event("change")
    wait_until(page, lambda: stored(gateway, key, conversation_id)["metadata"]["temperature"] == "1.2")
    page.reload()                                            # the settings come back with the conversation
    expect(page.locator("#temperature")).to_have_value("1.2")
    expect(page.locator("#max-tokens")).to_have_value("40")
    expect(page.locator("#system-prompt")).to_have_value("Be brief.")
    first_answer = stored(gateway, key, conversation_id)["messages"][2]

    calls = len(gateway.fake.calls)
    page.locator("article.message.assistant .regenerate").click()
    wait_until(page, lambda: len(gateway.fake.calls) > calls)
    expect(page.locator("article.message.assistant .stats")).not_to_be_empty()
    expect(page.locator("article.message")).to_have_count(2)
    sent = gateway.fake.calls[-1].request
    assert [(m.role, m.content) for m in sent.chat.messages] == [("system", "Be brief."), ("user", "[words:5] hi")]
    assert sent.sampling.temperature == pytest.approx(1.2)
    after = stored(gateway, key, conversation_id)["messages"]
    assert [m["role"] for m in after] == ["system", "user", "assistant"]
    assert after[2]["id"] != first_answer["id"]              # the answer was replaced, not added

    page.locator("article.message.user .edit").click()
    editor = page.locator("article.message.user .editor textarea")
    expect(editor).to_be_focused()
    editor.fill("[words:3] edited")
    page.keyboard.press("Enter")
    expect(page.locator("article.message")).to_have_count(2)
    expect(page.locator("article.message.user .body")).to_have_text("[words:3] edited")
    expect(page.locator("article.message.assistant .body")).to_have_text("w0 w1 w2")
    after = stored(gateway, key, conversation_id)["messages"]
    assert [(m["role"], m["content"]) for m in after] == [
        ("system", "Be brief."), ("user", "[words:3] edited"), ("assistant", "w0 w1 w2 ")]


def test_conversation_list_rename_delete_and_order(gateway: GatewayHarness, page: Page):
    org_id, _, key = gateway.new_org("list")
    older = conversation_with(gateway, org_id, "Older chat", ("user", "a"), ("assistant", "b"))
    newer = conversation_with(gateway, org_id, "", ("user", "c"), ("assistant", "d"))
    use_key(page, gateway, key)
    items = page.locator("#conversations li")
    expect(items).to_have_count(2)
    assert [items.nth(i).get_attribute("data-id") for i in range(2)] == [newer, older]   # newest first
    expect(items.nth(0).locator(".open")).to_have_text(re.compile(r"^Untitled · "))     # never a bare id

    page.locator(f"#conversations li[data-id='{older}'] .rename").click()
    page.locator(".rename-input").fill("Renamed chat")
    page.keyboard.press("Enter")
    expect(page.locator(f"#conversations li[data-id='{older}'] .open")).to_have_text("Renamed chat")
    page.confirms.append("delete")
    page.locator(f"#conversations li[data-id='{newer}'] .delete").click()
    expect(items).to_have_count(1)

    page.reload()
    expect(items).to_have_count(1)
    expect(items.nth(0).locator(".open")).to_have_text("Renamed chat")
    assert gateway.http.get(f"/v1/conversations/{newer}", headers={"Authorization": f"Bearer {key}"}).status_code == 404


def test_rate_limited_shows_when_to_retry(gateway: GatewayHarness, page: Page):
    _, _, key = gateway.new_org("errors", rpm=1)
    use_key(page, gateway, key)
    page.locator("#prompt").fill("[words:2] one")
    page.keyboard.press("Enter")
    expect(page.locator("article.message.assistant .body")).to_have_text("w0 w1")

    page.locator("#prompt").fill("[words:2] two")
    page.keyboard.press("Enter")                             # over 1 request a minute
    status = page.locator("#status")
    expect(status).to_contain_text("Rate limited")
    expect(status).to_have_attribute("role", "alert")
    first = int(re.search(r"Retry in (\d+) s", status.inner_text()).group(1))
    assert 1 < first <= 60
    sooner = "|".join(str(n) for n in range(1, first))      # any later second: a slow poll may skip one
    expect(status).to_contain_text(re.compile(rf"Retry in ({sooner}) s"), timeout=3000)   # it counts down
    expect(page.locator("#prompt")).to_have_value("[words:2] two")               # the text is back
    expect(page.locator("article.message")).to_have_count(2)


def test_context_too_long_and_model_unavailable(browser: Browser, tmp_path: Path, conversations_address):
    cfg = gateway_config(f"sqlite:///{tmp_path / 'g.db'}", conversations_address,
                         upstream={**UpstreamConfig().__dict__, "models_cache_ttl_s": 0, "keepalive_interval_s": 0.2})
    with GatewayHarness(cfg) as gateway:
        gateway.fake.models["cold-model"] = 0                # listed, but no worker of it has reported
        _, _, key = gateway.new_org("errors")
        page = browser.new_page()
        use_key(page, gateway, key)
        page.locator("#prompt").fill("[too-long] a huge prompt")
        page.keyboard.press("Enter")
        expect(page.locator("#status")).to_contain_text("Too long for the context of fake-model")
        expect(page.locator("article.message")).to_have_count(0)

        page.select_option("#model", "cold-model")
        page.locator("#prompt").fill("hello")
        page.keyboard.press("Enter")
        expect(page.locator("#status")).to_contain_text("The model cold-model is unavailable right now")
        expect(page.locator("#status")).to_contain_text(re.compile(r"Retry in 1 s|You can retry now"))
        expect(page.locator("#prompt")).to_have_value("hello")
        page.close()


def test_narrow_layout_themes_and_screenshots(gateway: GatewayHarness, browser: Browser, tmp_path: Path):
    """Phone-sized: no horizontal scroll even with a wide table and code; the list opens as a drawer.
    The themes follow the system. CHAT_PAGE_SCREENSHOTS=docs/img writes the README's screenshots."""
    org_id, _, key = gateway.new_org("narrow")
    shown = conversation_with(gateway, org_id, "Fibonacci in Python", ("user", "Show me a Fibonacci function and a table."),
                      ("assistant", SCREENSHOT_REPLY))
    conversation_with(gateway, org_id, "Packing list for a weekend hike", ("user", "a"), ("assistant", "b"))
    out = Path(os.environ.get("CHAT_PAGE_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    backgrounds = {}
    for scheme in ("light", "dark"):
        for name, viewport in (("wide", {"width": 1200, "height": 760}), ("narrow", {"width": 375, "height": 760})):
            context = browser.new_context(viewport=viewport, color_scheme=scheme)
            page = context.new_page()
            page.goto(gateway.base_url + "/")
            page.evaluate(f"localStorage.setItem('llmserve.apiKey', {key!r});"
                          f"localStorage.setItem('llmserve.conversation', {shown!r})")
            page.reload()
            expect(page.locator("figure.code-block")).to_have_count(1)
            if name == "narrow":
                widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth,"
                                       " document.body.scrollWidth]")
                assert widths[0] <= widths[1] and widths[2] <= widths[1], widths
                menu = page.locator("#menu")
                expect(menu).to_be_visible()
                expect(page.locator("#sidebar")).not_to_be_in_viewport()
                menu.click()
                expect(menu).to_have_attribute("aria-expanded", "true")
                expect(page.locator("#sidebar")).to_be_in_viewport()
                expect(page.locator("#new-conversation")).to_be_focused()
                page.keyboard.press("Escape")
                expect(page.locator("#sidebar")).not_to_be_in_viewport()
                expect(menu).to_be_focused()
            page.wait_for_timeout(250)
            page.screenshot(path=str(out / f"chat-{name}-{scheme}.png"))
            backgrounds[scheme] = page.evaluate("getComputedStyle(document.body).backgroundColor")
            context.close()
    assert backgrounds["light"] == "rgb(255, 255, 255)" and backgrounds["dark"] != backgrounds["light"]


def test_dev_key_only_in_local_mode(gateway: GatewayHarness, browser: Browser, tmp_path: Path, conversations_address):
    page = browser.new_page()
    page.goto(gateway.base_url + "/")
    expect(page.locator("#status")).to_have_text("Enter an API key to start.")
    expect(page.locator("#api-key")).to_have_value("")
    assert gateway.http.get("/chat/config").json() == {"dev_api_key": None}
    page.close()

    cfg = gateway_config(f"sqlite:///{tmp_path / 'local.db'}", conversations_address,
                         local_mode={**LocalModeConfig().__dict__, "enabled": True, "api_key": "sk-page-dev"})
    with GatewayHarness(cfg) as local:
        page = browser.new_page()
        page.goto(local.base_url + "/")
        expect(page.locator("#api-key")).to_have_value("sk-page-dev")
        expect(page.locator("#model option[value='fake-model']")).to_have_count(1)
        expect(page.locator("#prompt")).to_be_focused()
        page.close()


SCREENSHOT_REPLY = """Here is an iterative version, which runs in linear time:

```python
def fibonacci(n: int) -> int:
    \"\"\"The n-th Fibonacci number (fibonacci(0) == 0).\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
```

| n  | fibonacci(n) | digits |
|----|--------------|--------|
| 10 | 55           | 2      |
| 50 | 12586269025  | 11     |

- **Time:** O(n) additions
- **Memory:** two integers, whatever `n` is
"""
