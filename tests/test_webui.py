"""The built-in chat page (swiftlm/server/webui/, served by swiftlm/server/webui_route.py).

In-process (Starlette's TestClient, no model): the page and its assets with their content types and
headers, ``--no-webui``, the key rule (the page without a key, the API with one), and that the shipped
files name no other host.  In a browser (Playwright driving Debian's Chromium) against one real
``swiftlm serve`` with two models: a streamed answer, Stop cancelling the request on the server, the
model picker, reasoning and sanitized markdown, attachments, the API-key prompt, the phone layout and
basic accessibility; and no request ever leaves the server's origin.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from conftest import make_ckpt
from starlette.testclient import TestClient

from swiftlm.config import Settings, add_settings_arguments, settings_from_args
from swiftlm.server.app import create_app
from swiftlm.server.webui_route import CSP, WEBUI_DIR

KEY = "sk-webui-test"


def client(**settings) -> TestClient:
    return TestClient(create_app(Settings(**settings)), raise_server_exceptions=False)


# ---------------------------------------------------------------------------------------------- in-process


def test_page_and_assets_served_with_types_and_csp():
    types = {".js": "text/javascript", ".mjs": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    with client() as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        assert r.headers["content-security-policy"] == CSP and "default-src 'self'" in CSP
        assert "http" not in CSP.replace("https:", "")  # no host named: only 'self' (and in-browser data:/blob:)
        assert r.headers["x-content-type-options"] == "nosniff"
        # every asset the page names, and every module those import, is served with its type
        todo = [p.removeprefix("webui/") for p in re.findall(r'(?:src|href)="([^"#]+)"', r.text)]
        seen = set()
        while todo:
            rel = todo.pop()
            if rel in seen:
                continue
            seen.add(rel)
            a = c.get(f"/webui/{rel}")
            assert a.status_code == 200, rel
            assert a.headers["content-type"].startswith(types[Path(rel).suffix]), rel
            if rel.endswith((".js", ".mjs")):
                for imp in re.findall(r'^\s*import\b[^"\']*["\'](\.[^"\']+)["\']', a.text, re.M):
                    todo.append(os.path.normpath(os.path.join(os.path.dirname(rel), imp)))
        assert {"js/app.js", "js/api.js", "vendor/marked.esm.js", "vendor/purify.es.mjs", "style.css"} <= seen
        # conditional GET, unknown files and paths outside the folder
        assert c.get("/", headers={"If-None-Match": r.headers["etag"]}).status_code == 304
        for bad in ("/webui/nope.js", "/webui/../config.py", "/webui/%2e%2e/app.py", "/webui//etc/passwd"):
            assert c.get(bad).status_code == 404, bad
        assert c.post("/").status_code == 405


def test_no_webui_turns_the_page_off():
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    assert settings_from_args(p.parse_args(["--no-webui"])).webui is False
    assert settings_from_args(p.parse_args([])).webui is True
    with client(webui=False) as c:
        for path in ("/", "/webui/js/app.js", "/webui/info"):
            r = c.get(path)
            assert r.status_code == 404 and r.json()["error"]["message"] == f"no route {path}"
        assert c.get("/health").status_code == 503  # the rest of the app is unchanged (no model here)


def test_page_needs_no_key_and_the_api_does():
    auth = {"Authorization": f"Bearer {KEY}"}
    with client(api_key=KEY) as c:
        assert c.get("/").status_code == 200
        assert c.get("/webui/js/app.js").status_code == 200
        assert c.get("/webui/vendor/purify.es.mjs").status_code == 200
        for path in ("/webui/info", "/v1/models"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            assert c.get(path, headers=auth).status_code == 200, path
        assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 401
        info = c.get("/webui/info", headers=auth).json()
        assert info["defaults"] == {"temperature": 0.6, "top_p": 1.0, "max_tokens": 2048, "thinking": False}
        assert info["media"] == {"image": False, "audio": False}


def test_info_reports_what_each_model_takes():
    class Policy:
        image, audio = True, False

    class Engine:
        media_policy = Policy()

    class Spec:
        name = "vlm"

    app = create_app(Settings(vision=True, temp=0.2), engine=Engine(), spec=Spec())
    with TestClient(app) as c:
        info = c.get("/webui/info").json()
    assert info["models"] == {"vlm": {"modalities": ["text", "image"]}}
    assert info["media"] == {"image": True, "audio": False} and info["defaults"]["temperature"] == 0.2


# URLs that appear in the shipped files but are never requested: XML namespace names, and the vendored
# libraries' project links in their banner comments and error messages.
NOT_FETCHED = {
    "http://www.w3.org/2000/svg",
    "http://www.w3.org/1999/xhtml",
    "http://www.w3.org/1998/Math/MathML",
}
VENDOR_REFERENCES = {
    "https://github.com/markedjs/marked",
    "https://github.com/markedjs/marked.",
    "https://bugs.chromium.org/p/chromium/issues/detail?id=1305293",
    "https://github.com/babel/babel/blob/main/packages/babel-helpers/LICENSE",
    "https://github.com/sindresorhus/validate-element-name",
}


def test_shipped_files_name_no_other_host():
    files = [p for p in WEBUI_DIR.rglob("*") if p.is_file()]
    assert files and (WEBUI_DIR / "index.html") in files
    found = {}
    for p in files:
        if "LICENSE" in p.name:
            continue  # licence text
        for url in re.findall(r"""https?://[^\s'"`)<>\\]+""", p.read_text(errors="replace")):
            found.setdefault(url, []).append(p.relative_to(WEBUI_DIR).as_posix())
    ours = {u: where for u, where in found.items() if any(not w.startswith("vendor/") for w in where)}
    assert set(ours) <= NOT_FETCHED, ours
    assert set(found) <= NOT_FETCHED | VENDOR_REFERENCES, found


def test_vendored_files_are_the_published_ones():
    readme = (WEBUI_DIR / "vendor" / "README.txt").read_text()
    for name in ("marked.esm.js", "purify.es.mjs"):
        digest = hashlib.sha256((WEBUI_DIR / "vendor" / name).read_bytes()).hexdigest()
        assert digest in readme, f"vendor/{name} differs from the copy README.txt records"
    for lic in ("marked.LICENSE.txt", "dompurify.LICENSE-APACHE.txt", "dompurify.LICENSE-MPL.txt"):
        assert (WEBUI_DIR / "vendor" / lic).stat().st_size > 1000


# ---------------------------------------------------------------------------------------------- browser

CHROMIUM = os.environ.get("SWIFTLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium not found ({CHROMIUM}): the chat page's browser test drives Debian's chromium "
            "through Playwright. Run scripts/test.sh, which installs it with apt-get "
            "(or `apt-get install chromium`; SWIFTLM_CHROMIUM=/path/to/chrome picks another)."
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server: the bundled SmolLM2 (loaded at start) and a tiny random llama (loaded on demand)."""
    from server_util import ServerProc

    tiny = make_ckpt(tmp_path_factory.mktemp("ck") / "llama", "--arch", "llama", "--dtype", "float32")
    # one torch thread: on a small machine shared with other work, torch's spinning worker threads
    # slow each token down many times over; the page is under test, not the speed
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        s = ServerProc("--model", "smollm2-135m-instruct", "--model", str(tiny), "--backend", "torch", "--seed", "1")
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    s.tiny = str(tiny)
    yield s
    assert s.stop() == 0, s.stderr_tail()


@pytest.fixture
def page(browser, served):
    """A fresh browser context (empty storage) on the page; afterwards: every request went to the
    server's origin and the page threw no error."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    urls: list[str] = []
    errors: list[str] = []
    ctx.on("request", lambda r: urls.append(r.url))
    pg = ctx.new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    pg.set_default_timeout(60_000)
    pg.goto(served.base + "/")
    pg.wait_for_selector("body[data-ready=true]")
    yield pg
    ctx.close()
    foreign = [u for u in urls if not u.startswith(served.base + "/") and not u.startswith(("data:", "blob:"))]
    assert not foreign, f"the page contacted another host: {foreign}"
    assert not errors, errors  # no script error, nothing the page's own CSP refused


def health(served) -> dict:
    return httpx.get(served.base + "/health", timeout=30).json()["stats"]


def set_options(pg, **fields) -> None:
    pg.click("#open-settings")
    for sel, value in fields.items():
        pg.fill(f"#{sel.replace('_', '-')}", str(value))
    pg.keyboard.press("Escape")  # the dialog closes and keeps what was typed
    pg.wait_for_selector("#settings", state="hidden")
    # the dialog's close event (which saves the form, then focuses the settings button) is a task queued after the
    # dialog hides: a prompt sent before it runs would go with the old settings
    until(pg, "document.activeElement && document.activeElement.id === 'open-settings'")


def until(pg, expr: str, timeout: float = 60) -> None:
    """Poll a JavaScript expression (Playwright's wait_for_function evaluates strings, which the
    page's CSP forbids)."""
    deadline = time.time() + timeout
    while not pg.evaluate(expr):
        assert time.time() < deadline, f"timed out waiting for {expr}"
        time.sleep(0.1)


def answer(pg):
    return pg.locator(".msg.assistant").last


WATCH = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const a = [...document.querySelectorAll('.msg.assistant .content')].pop();
    if (a) window.lengths.push(a.textContent.length);
  }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
}"""


def test_streamed_answer_grows_token_by_token(page, served):
    page.evaluate("localStorage.setItem('swiftlm.settings.v1', JSON.stringify({temperature: 0, max_tokens: 10}))")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    # keyboard only: the skip link leads to the message box; Enter sends
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip-link"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.keyboard.type("Write a short poem about the sea.")
    page.evaluate(WATCH)
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .stats:not([hidden])")
    # the answer's text length at each change of the page: several snapshots, ending with the whole
    # (not strictly growing: '**bo' is longer than the rendered 'bold' a token later)
    lengths = page.evaluate("window.lengths")
    assert len({n for n in lengths if n}) >= 3 and lengths[-1] == max(lengths), lengths
    text = answer(page).locator(".content").inner_text()
    assert len(text.strip()) > 5
    stats = answer(page).locator(".stats").inner_text()
    assert re.search(r"[0-9.]+ tok/s · TTFT [0-9.]+ s · \d+ tokens", stats), stats
    assert "~" not in stats  # the token count is the server's usage (stream_options.include_usage)
    # kept in localStorage: a reload shows the conversation again
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".chat-open").first.inner_text().startswith("Write a short poem")
    assert answer(page).locator(".content").inner_text() == text


def test_stop_cancels_the_request_on_the_server(page, served):
    cancelled = health(served)["requests_finished"].get("cancelled", 0)
    set_options(page, max_tokens=3000)
    page.fill("#prompt", "Count from 1 to 1000, one number after another, separated by commas.")
    page.click("#send")
    until(page, "document.querySelector('.msg.assistant:last-child .content').textContent.length > 0")
    assert health(served)["requests_active"] == 1
    page.click("#stop")
    page.wait_for_selector("#send:not([hidden])")
    deadline = time.time() + 20
    while health(served)["requests_active"] != 0 and time.time() < deadline:
        time.sleep(0.2)
    st = health(served)
    assert st["requests_active"] == 0 and st["requests_finished"].get("cancelled", 0) == cancelled + 1, st
    assert "stopped" in answer(page).locator(".stats").inner_text()
    assert answer(page).locator(".content").inner_text()  # the text so far stays


def test_model_picker_switches_models(page, served):
    options = page.locator("#model option").all_inner_texts()
    assert options == ["smollm2-135m-instruct (loaded)", f"{served.tiny} (unloaded)"], options
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions") else 0)
    page.select_option("#model", served.tiny)
    set_options(page, max_tokens=6)
    page.fill("#prompt", "hello")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .stats:not([hidden])")
    assert bodies[-1]["model"] == served.tiny and bodies[-1]["stream_options"] == {"include_usage": True}
    assert answer(page).locator(".who").inner_text() == f"Assistant · {served.tiny}"
    assert answer(page).locator(".error").is_hidden()
    assert re.search(r"\b6 tokens", answer(page).locator(".stats").inner_text())
    until(page, "[...document.querySelectorAll('#model option')].every(o => o.text.endsWith('(loaded)'))")


SSE = (
    "".join(
        f"data: {json.dumps(c)}\n\n"
        for c in [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"reasoning_content": "Let me think about **this**."}}]},
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "content": "Here is `code`:\n\n```python\nprint(1)\n```\n\n"
                            '<img src=x onerror="window.pwned=1"> [bad](javascript:window.pwned=2) '
                            "![pic](http://evil.example/x.png) <script>window.pwned=3</script> **done**"
                        },
                    }
                ]
            },
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
        ]
    )
    + "data: [DONE]\n\n"
)


def test_reasoning_is_folded_and_markdown_sanitized(page):
    page.route("**/v1/chat/completions", lambda r: r.fulfill(status=200, content_type="text/event-stream", body=SSE))
    page.fill("#prompt", "think")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .stats:not([hidden])")
    msg = answer(page)
    details = msg.locator("details.reasoning")
    assert details.is_visible() and details.get_attribute("open") is None  # folded
    assert msg.locator(".reasoning-body").inner_text() == ""  # hidden until unfolded
    details.locator("summary").click()
    assert msg.locator(".reasoning-body").inner_text().strip() == "Let me think about this."
    content = msg.locator(".content")
    assert content.locator("pre code").inner_text().strip() == "print(1)"
    assert content.locator("strong").inner_text() == "done"
    assert content.locator("img, script, [onerror]").count() == 0
    assert content.locator("a[href^='javascript']").count() == 0
    assert content.locator("a", has_text="pic").get_attribute("rel") == "noopener noreferrer"
    assert page.evaluate("window.pwned") is None
    assert msg.locator("button.copy").count() == 1
    assert "9 tokens" in msg.locator(".stats").inner_text()


PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
WAV = b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00@\x1f\x00\x00\x80>\x00\x00\x02\x00\x10\x00data\x00\x00\x00\x00"


def test_attachments_become_content_parts(page):
    def info(route):
        data = route.fetch().json()
        data["models"] = {name: {"modalities": ["text", "image", "audio"]} for name in data["models"]}
        route.fulfill(json=data)

    bodies = []

    def chat(route):
        bodies.append(json.loads(route.request.post_data))
        route.fulfill(status=200, content_type="text/event-stream", body=SSE)

    page.route("**/webui/info", info)
    page.route("**/v1/chat/completions", chat)
    assert page.is_hidden("#attach-image")  # SmolLM2 takes text only
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.is_visible("#attach-image") and page.is_visible("#attach-audio")
    page.set_input_files("#image-input", files=[{"name": "dot.png", "mimeType": "image/png", "buffer": PNG}])
    page.set_input_files("#audio-input", files=[{"name": "hum.wav", "mimeType": "audio/wav", "buffer": WAV}])
    # the files are read asynchronously (FileReader): wait for both items, then check there are exactly two
    until(page, "document.querySelectorAll('#attachments li').length >= 2", timeout=10)
    assert page.locator("#attachments li").count() == 2
    page.fill("#prompt", "what is this?")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .stats:not([hidden])")
    parts = bodies[-1]["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": "what is this?"}
    assert parts[1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()},
    }
    assert parts[2] == {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"}}
    assert page.locator(".msg.user img").count() == 1 and page.locator("#attachments li").count() == 0


def test_api_key_prompt(page):
    """The server's 401 (stood in for here by the browser: the real key check is tested in-process
    above) brings up the key field; the key then goes with every API call as a Bearer token."""
    sent = []

    def gate(route):
        auth = route.request.headers.get("authorization")
        sent.append((route.request.url.rsplit("/", 1)[-1], auth))
        if auth != f"Bearer {KEY}":
            return route.fulfill(status=401, json={"error": {"message": "missing or invalid API key"}})
        route.continue_()

    page.route(re.compile(r".*/(v1/.*|webui/info)$"), gate)
    page.reload()
    page.wait_for_selector("#key-form:not([hidden])")
    assert page.evaluate("document.activeElement.id") == "api-key"
    page.keyboard.type(KEY)
    page.keyboard.press("Enter")
    page.wait_for_selector("#key-form", state="hidden")
    assert page.locator("#model option").count() == 2
    assert sent[-1][1] == f"Bearer {KEY}"
    assert page.evaluate("sessionStorage.getItem('swiftlm.apikey')") == KEY
    assert page.evaluate("localStorage.getItem('swiftlm.apikey')") is None  # not remembered unless asked


CONTRAST = """() => {
  const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (c) => ((c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const bg = (e) => {
    for (; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor);
      if (c.length === 3 || (c.length === 4 && c[3] > 0)) return c.slice(0, 3);
    }
    return [255, 255, 255];
  };
  const out = {};
  for (const sel of ['body', '.hint', '.who', '.stats', '#send', '#open-settings', '.chat-open', '.msg.user .content',
                     '.model-pick label']) {
    const e = document.querySelector(sel);
    if (!e || (e !== document.body && !e.offsetParent)) continue;  // not shown at this width
    const [a, b] = [lum(rgb(getComputedStyle(e).color)), lum(bg(e))];
    out[sel] = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  }
  return out;
}"""

UNLABELLED = """() => [...document.querySelectorAll('input, select, textarea')]
  .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.getAttribute('aria-labelledby'))
  .map(e => e.id)"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_phone_width_labels_and_contrast(page, scheme):
    page.emulate_media(color_scheme=scheme)
    page.set_viewport_size({"width": 390, "height": 844})
    page.evaluate(  # a conversation in storage, so that its bubbles are measured too
        "() => { const c = {id: 'x', title: 'hi', messages: [{role: 'user', content: 'hi'}, "
        "{role: 'assistant', content: 'hello', model: 'm', stats: {ttft: 0.1, tps: 10, tokens: 3, finish: 'stop'}}], "
        "updated: 1}; localStorage.setItem('swiftlm.chats.v1', JSON.stringify({chats: [c], current: 'x'})); }"
    )
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than a phone
    assert page.evaluate(UNLABELLED) == []
    ratios = page.evaluate(CONTRAST)
    assert len(ratios) >= 7 and min(ratios.values()) >= 4.5, ratios
    # the chat list folds away behind a button; Escape closes it again
    assert not page.locator(".chat-open").first.is_visible()
    page.click("#toggle-sidebar")
    assert page.get_attribute("#toggle-sidebar", "aria-expanded") == "true"
    page.wait_for_selector(".chat-open", state="visible")
    page.keyboard.press("Escape")
    assert page.get_attribute("#toggle-sidebar", "aria-expanded") == "false"
