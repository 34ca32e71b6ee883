"""The chat page at `mlxllama serve`'s `/`, in a real browser: Playwright driving Debian's Chromium
(.ci/run installs it with apt-get) against a real server on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

playwright = pytest.importorskip("playwright.sync_api")

import mlxllama
from conftest import PACKAGE_DATA, Server
from mlxllama.prompt import build_prompt, choose_template, messages_for

CHROMIUM = os.environ.get("MLXLLAMA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium)")
SCREENSHOT = os.environ.get("MLXLLAMA_WEBUI_SCREENSHOT")  # where the compare test saves the page, if set


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context()
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    page.goto(server.url)
    page.wait_for_function("document.querySelector('#template').options.length > 1")
    yield page
    context.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def runtime():
    return mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")  # the model `serve` runs without -m


def greedy(runtime, message: str, template: bool = True) -> tuple[str, list[int]]:
    """`mlxllama generate`'s greedy reply and prompt ids (`--show-prompt`), in this process."""
    chosen = choose_template(runtime.chat_template, no_template=not template)
    prompt = build_prompt(runtime.tokenizer, chosen, messages_for(message, None))
    return runtime.generate(prompt.ids, max_tokens=256).text, prompt.ids


def send(page, text: str, replies: int = 1) -> None:
    before = page.locator("details.fed, .message.assistant .error-text, .finish").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function(f"document.querySelectorAll('details.fed, .message.assistant .error-text, .finish').length"
                           f" >= {before + replies} && !document.querySelector('#send').disabled", timeout=60_000)


def replies(page) -> list[str]:
    return [node.text_content() for node in page.query_selector_all(".message.assistant .content")]


def test_a_message_streams_the_cli_reply_with_what_the_model_was_fed_and_survives_a_reload(page, runtime):
    question = "What is the capital of Japan?"
    send(page, question)
    text, ids = greedy(runtime, question)
    assert replies(page) == [text] == ["The capital of Japan is Tokyo."]
    panel = page.locator("details.fed").last
    panel.locator("summary").first.click()
    assert [int(i.text_content()) for i in panel.locator(".ids span").all()] == ids
    # hovering a piece shows its id, an id its piece; special tokens are marked
    assert panel.locator(".pieces span").nth(0).get_attribute("title") == f"id {ids[0]}"
    assert panel.locator(".ids span").nth(0).get_attribute("title") == "<s>"
    assert panel.locator(".rendered mark.special").first.text_content() == "</s>"
    figures = panel.locator(".figures").text_content()
    assert f"prompt tokens {len(ids)}" in figures and "generated 8" in figures and "finish: stop" in figures
    assert "template: gguf (zephyr)" in panel.locator(".template-name").text_content()
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert replies(page) == [text]
    assert page.locator("#conversations li").first.text_content() == question


def test_template_none_and_compare_show_both_replies_as_the_cli_gives_them(page, runtime):
    page.click("#settings-toggle")
    page.select_option("#template", "none")
    send(page, "The capital of Italy is")
    assert replies(page) == [greedy(runtime, "The capital of Italy is", template=False)[0]]
    page.select_option("#template", "")
    page.check("#compare")
    send(page, "What is 17 plus 25?", replies=2)
    templated = page.locator(".message.assistant[data-side=templated] .content").last.text_content()
    raw = page.locator(".message.assistant[data-side=raw] .content").last.text_content()
    assert templated == greedy(runtime, "What is 17 plus 25?")[0] == "17 plus 25 is 42."
    assert raw == greedy(runtime, "What is 17 plus 25?", template=False)[0]
    raw_panel = page.locator(".message.assistant[data-side=raw] details.fed").last
    assert "template: none" in raw_panel.locator(".template-name").text_content()
    raw_ids = greedy(runtime, "What is 17 plus 25?", template=False)[1]
    assert [int(i.text_content()) for i in raw_panel.locator(".ids span").all()] == raw_ids
    if SCREENSHOT:
        page.click("#settings-toggle")
        for panel in page.locator("details.fed").all()[-2:]:
            panel.locator("summary").first.click()
        page.screenshot(path=SCREENSHOT, full_page=True)


def test_stop_ends_a_long_reply_frees_the_slot_and_the_next_message_runs(page, server):
    page.click("#settings-toggle")
    page.select_option("#template", "none")
    page.fill("#temperature", "3")
    page.fill("#seed", "1")
    page.fill("#max_tokens", "2000")
    page.fill("#input", "Once upon a time")
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant .content').textContent.length > 0")
    page.click("#stop-button")
    page.wait_for_selector(".finish")
    assert page.locator(".finish").text_content() == "[stopped]"
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/health").json()["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/health").json()["requests_running"] == 0
    page.fill("#temperature", "0")
    page.select_option("#template", "")
    send(page, "What is the capital of Japan?")
    assert replies(page)[-1] == "The capital of Japan is Tokyo."


HOSTILE = ['<script>window.__pwned = 1</script>', '<img src=x onerror="window.__pwned = 2">',
           '<a href="javascript:window.__pwned = 3" id="hostile-link">click</a>']


def fake_stream(route) -> None:
    chunks = [{"choices": [{"index": 0, "delta": {"content": piece + "\n"}, "finish_reason": None}]} for piece in HOSTILE]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "prompt": {"template": "<b>t</b>", "text": HOSTILE[1], "token_ids": [1]}})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


def test_hostile_replies_and_metadata_run_nothing(page):
    page.route("**/v1/chat/completions", fake_stream)
    send(page, "hello")
    page.locator("details.fed summary").first.click()
    page.locator("details.template-source summary").first.click()
    assert replies(page)[-1] == "\n".join(HOSTILE) + "\n"  # shown as text, every character of it
    assert page.locator("#messages img, #messages script, #messages a").count() == 0
    page.locator(".message.assistant .content").last.click()
    assert page.evaluate("window.__pwned") is None


def test_a_stopped_server_is_an_error_in_the_conversation_and_keeps_what_was_shown(browser):
    server = Server("--api-key", "sesame")
    page = browser.new_page()
    try:
        page.goto(server.url)
        page.wait_for_selector("#key-dialog[open]")  # /props answered 401: the page asks for the key
        assert "the server needs an API key" in page.text_content("#notice")
        page.fill("#key-input", "sesame")
        page.click("#key-save")
        page.wait_for_function("document.querySelector('#template').options.length > 1")
        send(page, "What is the capital of Japan?")
        assert replies(page) == ["The capital of Japan is Tokyo."]
        server.stop()
        send(page, "What is 17 plus 25?")
        assert "cannot reach the server" in page.locator(".message.assistant .error-text").last.text_content()
        assert replies(page)[0] == "The capital of Japan is Tokyo."
    finally:
        page.close()
        if server.process.poll() is None:
            server.stop()


def test_shift_enter_regenerate_edit_and_resend_conversations_and_export(page, runtime):
    page.fill("#input", "What is")
    page.press("#input", "Shift+Enter")
    assert page.input_value("#input") == "What is\n" and page.locator(".message").count() == 0
    page.fill("#input", "")
    send(page, "What is the capital of Japan?")
    page.click("button.regenerate")
    page.wait_for_function("document.querySelector('details.fed') && !document.querySelector('#send').disabled")
    assert replies(page) == ["The capital of Japan is Tokyo."]
    page.click("button.edit")
    page.fill(".message.user textarea", "What is 17 plus 25?")
    page.click("button.resend")
    page.wait_for_function("document.querySelector('details.fed') && !document.querySelector('#send').disabled")
    assert replies(page) == ["17 plus 25 is 42."] and page.locator(".message.user").count() == 1
    with page.expect_download() as download:
        page.click("#export")
    transcript = json.loads(Path(download.value.path()).read_text())
    assert transcript == {"model": str(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf"), "template": "gguf (zephyr)",
                          "messages": [{"role": "user", "content": "What is 17 plus 25?"},
                                       {"role": "assistant", "content": "17 plus 25 is 42."}]}
    page.click("#new-chat")
    assert page.locator("#conversations li").count() == 2 and page.locator(".message").count() == 0
    page.locator("#conversations li").nth(1).click()
    assert replies(page) == ["17 plus 25 is 42."]


def test_code_blocks_keep_their_formatting(page):
    def code_reply(route):
        chunks = [{"choices": [{"index": 0, "delta": {"content": "Here:\n```python\ndef f():\n    return 1\n```\nDone."},
                                "finish_reason": None}]}, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"},
                      body="".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")

    page.route("**/v1/chat/completions", code_reply)
    send(page, "code please")
    assert page.locator(".message.assistant pre code").text_content() == "def f():\n    return 1\n"


def test_a_system_message_a_too_long_prompt_and_the_raw_side_continued(page, runtime):
    page.click("#settings-toggle")
    page.fill("#system", "You are terse.")
    send(page, "What is the capital of Japan?")
    panel = page.locator("details.fed").last
    assert "You are terse." in panel.locator(".rendered").text_content()
    chosen = choose_template(runtime.chat_template)
    expected = build_prompt(runtime.tokenizer, chosen, messages_for("What is the capital of Japan?", "You are terse."))
    assert replies(page) == [runtime.generate(expected.ids, max_tokens=256).text]
    send(page, "word " * 600)  # past chat-tiny's context of 512: the server's 400, in the conversation
    error = page.locator(".message.assistant .error-text").last.text_content()
    assert error.startswith("Error: HTTP 400:") and "context" in error
    assert replies(page)[0] == runtime.generate(expected.ids, max_tokens=256).text  # nothing shown is lost
    page.click("#new-chat")
    page.fill("#system", "")
    page.check("#compare")
    send(page, "The capital of Italy is", replies=2)
    first_raw = page.locator(".message.assistant[data-side=raw] .content").last.text_content()
    assert page.text_content("#notice") == ""
    send(page, "The capital of France is", replies=2)
    raw_panel = page.locator(".message.assistant[data-side=raw] details.fed").last
    # the raw side goes on as plain text: its previous raw prompt and reply, then the new message
    assert raw_panel.locator(".rendered").text_content() == f"The capital of Italy is{first_raw}\nThe capital of France is"
    assert "continued as plain text" in page.text_content("#notice")


def test_no_webui_serves_the_api_alone():
    server = Server("--no-webui")
    try:
        assert httpx.get(f"{server.url}/").status_code == 404
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_a_built_in_template_and_a_dropped_stream(page, runtime):
    page.click("#settings-toggle")
    page.select_option("#template", "chatml")
    send(page, "What is the capital of Japan?")
    chatml = choose_template(runtime.chat_template, "chatml")
    expected = build_prompt(runtime.tokenizer, chatml, messages_for("What is the capital of Japan?", None))
    assert replies(page) == [runtime.generate(expected.ids, max_tokens=256).text]
    panel = page.locator("details.fed").last
    assert panel.locator(".template-name").text_content() == "template: chatml"
    assert [int(i.text_content()) for i in panel.locator(".ids span").all()] == expected.ids

    def cut_off(route):  # a stream that stops after some text, with no finish_reason and no [DONE]
        chunk = {"choices": [{"index": 0, "delta": {"content": "Half a rep"}, "finish_reason": None}]}
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=f"data: {json.dumps(chunk)}\n\n")

    page.route("**/v1/chat/completions", cut_off)
    send(page, "Tell me more.")
    assert replies(page)[-1] == "Half a rep"  # what came is kept, and the break is said
    assert "stream ended before the reply did" in page.locator(".error-text").last.text_content()


def test_stop_strings_and_the_sampling_settings_reach_the_server(page):
    requests = []
    page.on("request", lambda request: requests.append(request.post_data_json) if request.url.endswith(
        "/v1/chat/completions") else None)
    page.click("#settings-toggle")
    page.fill("#stop", "Tokyo")
    for field, value in (("top_p", "0.9"), ("top_k", "40"), ("min_p", "0.05"), ("max_tokens", "64"), ("seed", "7")):
        page.fill(f"#{field}", value)
    send(page, "What is the capital of Japan?")
    assert replies(page) == ["The capital of Japan is "]
    body = requests[-1]
    assert (body["stop"], body["top_p"], body["top_k"], body["min_p"], body["max_tokens"], body["seed"]) == (
        ["Tokyo"], 0.9, 40, 0.05, 64, 7)
