"""A headless chromium for the tests, driven over the Chrome DevTools Protocol (CDP).

An HTML page can be valid markup and still show nothing: a script that throws, an image that fails to load or
decode, a chart hidden by a stylesheet. Only a browser sees those, so the tests that check a page open it in a
real chromium and ask it, over CDP's websocket, for the errors it logged, what is on screen, and a screenshot.

    with Browser(tmp_path) as page:
        page.open(tmp_path / "report.html")
        assert page.errors == []
        assert all(box["visible"] for box in page.visible("table"))
        page.screenshot(artefact_path(request))

Chromium runs headless from a fresh profile in a temporary folder, listens on 127.0.0.1 only, at a port it picks
itself (written to the profile's DevToolsActivePort file: no race for a free port), and needs no network. It is
always stopped on leaving, also when the body raised. Tests that need it are marked `browser`; the
`browser_page` fixture skips them, saying why, where chromium is not installed (scripts/test.sh installs it with
apt-get when it runs as root), and keeps a screenshot of the last page under build/test-artefacts/.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    import websocket  # websocket-client, in the `test` extra
except ImportError:  # the suite still collects; browser_missing_reason() says what is missing
    websocket = None

ROOT = Path(__file__).resolve().parents[1]
#: Where screenshots go, under the repository root: build/ is ignored by git and survives the run for a look.
ARTEFACTS = ROOT / "build" / "test-artefacts"
#: Names find_chromium looks up in PATH, in order, and Debian's own place for the browser when PATH misses it.
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DEBIAN_CHROMIUM = "/usr/bin/chromium"
#: Seconds allowed for chromium to write DevToolsActivePort and list a page target, for one CDP command's answer,
#: for a page's load event, and for chromium to exit on SIGTERM before it is killed.
START_TIMEOUT_S = 30
COMMAND_TIMEOUT_S = 30
LOAD_TIMEOUT_S = 30
STOP_TIMEOUT_S = 10
#: The window the page is laid out in (CSS pixels); a full-page screenshot grows its height to the content's.
WINDOW_SIZE = (1280, 800)
#: The tallest full-page screenshot taken (CSS pixels): a runaway page must not make a gigabyte PNG.
MAX_SCREENSHOT_HEIGHT = 16384
#: Characters of chromium's stderr quoted when it fails to start.
LOG_TAIL_CHARS = 3000
#: Console calls that count as errors (Runtime.consoleAPICalled's `type`): console.error and a failed console.assert.
CONSOLE_ERROR_TYPES = ("error", "assert")


def find_chromium() -> str | None:
    """The chromium (or Chrome) executable: the first of CHROMIUM_NAMES in PATH, else DEBIAN_CHROMIUM; None if
    neither exists."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return DEBIAN_CHROMIUM if os.access(DEBIAN_CHROMIUM, os.X_OK) else None


def browser_missing_reason() -> str | None:
    """Why Browser cannot run here, or None when it can."""
    if find_chromium() is None:
        return (f"chromium is not installed: none of {', '.join(CHROMIUM_NAMES)} in PATH or {DEBIAN_CHROMIUM} "
                "(scripts/test.sh installs the chromium package when it runs as root)")
    if websocket is None:
        return "could not import websocket (websocket-client drives chromium: pip install -e '.[test]')"
    return None


#: Skips a test, saying why, where chromium cannot be started.
requires_chromium = pytest.mark.skipif(browser_missing_reason() is not None, reason=browser_missing_reason() or "")


def artefact_path(request: pytest.FixtureRequest, suffix: str = ".png") -> Path:
    """build/test-artefacts/<the test's node id, made a file name><suffix>; the folder is created."""
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    return ARTEFACTS / (re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid).strip("_") + suffix)


class CDPError(RuntimeError):
    """Chromium answered a command with an error, or a page's script raised in Page.evaluate."""


#: urllib without proxies: chromium listens on 127.0.0.1, and an http_proxy setting must not reroute the request.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Connection:
    """One CDP websocket. Commands are numbered; `call` returns the result whose id matches, and every event read
    while waiting is passed to `on_event` and kept in `events` for `wait_event`."""

    def __init__(self, ws_url: str, on_event: Callable[[dict], None]) -> None:
        # No Origin header: chromium refuses websockets from an origin it was not told to allow.
        self._ws = websocket.create_connection(ws_url, timeout=COMMAND_TIMEOUT_S, suppress_origin=True,
                                               http_no_proxy=["127.0.0.1"])
        self._last_id = 0
        self._on_event = on_event
        self.events: collections.deque[dict] = collections.deque()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ws.close()

    def call(self, method: str, params: dict | None = None, timeout: float = COMMAND_TIMEOUT_S) -> dict:
        """Send one command and return its result; CDPError if chromium answers with an error."""
        self._last_id += 1
        command_id = self._last_id
        self._ws.send(json.dumps({"id": command_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while True:
            message = self._receive(deadline, f"an answer to {method}", timeout)
            if message.get("id") == command_id:
                if "error" in message:
                    raise CDPError(f"{method} failed: {message['error'].get('message')} "
                                   f"{message['error'].get('data', '')}".strip())
                return message.get("result", {})

    def wait_event(self, method: str, timeout: float) -> dict:
        """The params of the first queued or next arriving event named `method` (removed from the queue)."""
        for event in self.events:
            if event["method"] == method:
                self.events.remove(event)
                return event.get("params", {})
        deadline = time.monotonic() + timeout
        while True:
            message = self._receive(deadline, f"the event {method}", timeout)
            if message.get("method") == method and "id" not in message:
                return self.events.pop().get("params", {})  # _receive queued it last

    def _receive(self, deadline: float, what: str, timeout: float) -> dict:
        """The next message; an event is handed to on_event and queued before it is returned."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"chromium sent no {what} within {timeout} s")
        self._ws.settimeout(remaining)
        try:
            message = json.loads(self._ws.recv())
        except websocket.WebSocketTimeoutException:
            raise TimeoutError(f"chromium sent no {what} within {timeout} s") from None
        if "method" in message and "id" not in message:
            self._on_event(message)
            self.events.append(message)
        return message


class Page:
    """One page target of a running chromium: open a URL, read the errors it logged, evaluate script, check what is
    visible, take a screenshot."""

    def __init__(self, ws_url: str, browser_pid: int) -> None:
        self._errors: list[str] = []
        self._cdp = _Connection(ws_url, self._collect)
        #: The URL last opened, None before the first.
        self.url: str | None = None
        #: The browser process's pid, also the id of the process group of chromium and its helpers.
        self.browser_pid = browser_pid

    def close(self) -> None:
        self._cdp.close()

    def open(self, url: str | Path, timeout: float = LOAD_TIMEOUT_S) -> None:
        """Navigate to url (a Path is opened as a file:// URL) and wait for its load event, which comes after
        every image and script of the page has loaded or failed. Errors logged so far are kept."""
        url = url.resolve().as_uri() if isinstance(url, Path) else url
        for domain in ("Runtime", "Log", "Page"):
            self._cdp.call(f"{domain}.enable")
        self._cdp.events.clear()  # a load event of an earlier page must not end this wait
        answer = self._cdp.call("Page.navigate", {"url": url})
        if answer.get("errorText"):
            raise CDPError(f"chromium could not open {url}: {answer['errorText']}")
        try:
            self._cdp.wait_event("Page.loadEventFired", timeout)
        except TimeoutError:
            raise TimeoutError(f"{url} did not finish loading (no load event) within {timeout} s") from None
        self.url = url

    @property
    def errors(self) -> list[str]:
        """Every error the pages logged, as readable lines: console.error and failed console.assert calls,
        uncaught exceptions, and the browser's own error entries (a resource that failed to load, such as a
        missing image). One command's round trip first, so that events chromium sent before now are read."""
        self._cdp.call("Runtime.evaluate", {"expression": "0"})
        return list(self._errors)

    def _collect(self, event: dict) -> None:
        """Keep the error events among all that arrive, as lines of text."""
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in CONSOLE_ERROR_TYPES:
            text = " ".join(_remote_text(arg) for arg in params.get("args", []))
            frames = params.get("stackTrace", {}).get("callFrames", [])
            where = _where(frames[0]) if frames else ""
            self._errors.append(f"console.{params['type']}: {text}{where}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {})
            text = (exception.get("description") or details.get("text", "")).splitlines()[0]
            self._errors.append(f"uncaught exception: {text}{_where(details)}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            where = f" ({entry['url']})" if entry.get("url") else ""
            self._errors.append(f"{entry.get('source', 'browser')}: {entry.get('text', '')}{where}")

    def evaluate(self, expression: str) -> object:
        """The JSON value of a JavaScript expression in the page (a promise is awaited); CDPError with the
        script's own message if it throws. undefined comes back as None."""
        result = self._cdp.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                     "awaitPromise": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text", "")
            raise CDPError(f"the page's script raised: {text}")
        return result.get("result", {}).get("value")

    def visible(self, selector: str) -> list[dict]:
        """One dict per element matching the CSS selector, in document order:

        - `tag`: the element's tag name, lower case;
        - `width`, `height`: its getBoundingClientRect() size in CSS pixels (0 when it is not laid out);
        - `hidden_by`: "display:none", "visibility:hidden" (or ":collapse") or "opacity:0" where the computed
          style of the element or of an ancestor hides it (the nearest such one), else None;
        - `visible`: width and height above 0 and hidden_by None;
        - for <img>: `complete` (loading has ended, successfully or not) and `natural_width`, `natural_height`
          (0 for an image that failed to load or decode);
        - for <svg>: `content_width`, `content_height`, the size of what it draws (getBBox(); 0 for an empty one).
        """
        script = """(() => Array.from(document.querySelectorAll(%s), (el) => {
            const rect = el.getBoundingClientRect();
            let hiddenBy = null;
            for (let node = el; node && !hiddenBy; node = node.parentElement) {
                const style = getComputedStyle(node);
                if (style.display === "none") hiddenBy = "display:none";
                else if (style.visibility !== "visible") hiddenBy = "visibility:" + style.visibility;
                else if (Number(style.opacity) === 0) hiddenBy = "opacity:0";
            }
            const box = {tag: el.tagName.toLowerCase(), width: rect.width, height: rect.height, hidden_by: hiddenBy,
                         visible: rect.width > 0 && rect.height > 0 && hiddenBy === null};
            if (el instanceof HTMLImageElement) {
                Object.assign(box, {complete: el.complete, natural_width: el.naturalWidth,
                                    natural_height: el.naturalHeight});
            } else if (el instanceof SVGSVGElement) {
                let drawn = {width: 0, height: 0};
                try { drawn = el.getBBox(); } catch (e) { /* not rendered: nothing drawn */ }
                Object.assign(box, {content_width: drawn.width, content_height: drawn.height});
            }
            return box;
        }))()""" % json.dumps(selector)
        return self.evaluate(script)

    def screenshot(self, path: str | Path) -> Path:
        """Write a PNG of the whole page (not only the window) to path and return it. The window is grown to the
        page's laid-out size first (up to MAX_SCREENSHOT_HEIGHT), then set back."""
        metrics = self._cdp.call("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        width = max(WINDOW_SIZE[0], math.ceil(size["width"]))
        height = min(max(1, math.ceil(size["height"])), MAX_SCREENSHOT_HEIGHT)
        self._cdp.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                              "deviceScaleFactor": 1, "mobile": False})
        try:
            shot = self._cdp.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        finally:
            self._cdp.call("Emulation.clearDeviceMetricsOverride")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def _remote_text(arg: dict) -> str:
    """A console argument (a CDP RemoteObject) as the console would print it."""
    if "value" in arg:
        return arg["value"] if isinstance(arg["value"], str) else json.dumps(arg["value"])
    return str(arg.get("unserializableValue") or arg.get("description") or arg.get("type", "?"))


def _where(place: dict) -> str:
    """" (url:line)" for a CDP call frame or exception (lines counted from 1), or "" without a url."""
    return f" ({place['url']}:{place.get('lineNumber', 0) + 1})" if place.get("url") else ""


@contextlib.contextmanager
def Browser(tmp_path: Path) -> Iterator[Page]:  # noqa: N802  (used as a class: `with Browser(tmp) as page`)
    """Start a headless chromium with a fresh profile under tmp_path, yield a Page on its first tab, and stop it
    on leaving: SIGTERM, SIGKILL to its whole process group after STOP_TIMEOUT_S, and whatever of the group is
    left (renderers, the zygote) killed after that."""
    chromium = find_chromium()
    reason = browser_missing_reason()
    if chromium is None or reason is not None:
        raise RuntimeError(reason)
    folder = Path(tmp_path) / "chromium"
    profile, log_path = folder / "profile", folder / "chromium.log"
    profile.mkdir(parents=True, exist_ok=True)
    argv = [chromium, "--headless", f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
            "--disable-gpu",
            # A container's /dev/shm is often tiny: shared memory goes to the temporary folder instead.
            "--disable-dev-shm-usage",
            # No first-run dialogs, no calls home, nothing fetched from the network behind the tests' back.
            "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-breakpad",
            "--mute-audio", "--hide-scrollbars", f"--window-size={WINDOW_SIZE[0]},{WINDOW_SIZE[1]}"]
    if os.geteuid() == 0:
        argv.append("--no-sandbox")  # chromium's sandbox refuses to run as root
    argv.append("about:blank")
    with log_path.open("wb") as log:
        # A session of its own: chromium's helper processes share its process group, which _stop kills whole.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    page = None
    try:
        port = _wait_for_port(proc, profile / "DevToolsActivePort", log_path)
        page = Page(_page_target(proc, port, log_path), proc.pid)
        yield page
    finally:
        if page is not None:
            page.close()
        _stop(proc)


def _log_tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:].strip()
    except OSError:
        return ""


def _wait_for_port(proc: subprocess.Popen, port_file: Path, log_path: Path) -> int:
    """The port chromium writes to DevToolsActivePort (its first line; the file is complete once its second line,
    the browser's websocket path, is there); raises with chromium's output if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited ({proc.returncode}) before it listened:\n{_log_tail(log_path)}")
        with contextlib.suppress(OSError):
            lines = port_file.read_text().splitlines()
            if len(lines) >= 2 and lines[0].strip().isdigit():
                return int(lines[0])
        time.sleep(0.05)
    raise RuntimeError(f"chromium wrote no {port_file.name} within {START_TIMEOUT_S} s:\n{_log_tail(log_path)}")


def _page_target(proc: subprocess.Popen, port: int, log_path: Path) -> str:
    """The websocket URL of a page target from http://127.0.0.1:PORT/json (the first tab appears shortly after
    chromium listens)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited ({proc.returncode}):\n{_log_tail(log_path)}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            with _HTTP.open(f"http://127.0.0.1:{port}/json", timeout=COMMAND_TIMEOUT_S) as response:
                targets = json.loads(response.read().decode())
            pages = [t["webSocketDebuggerUrl"] for t in targets
                     if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
            if pages:
                return pages[0]
        time.sleep(0.05)
    raise RuntimeError(f"chromium listed no page target at 127.0.0.1:{port} within {START_TIMEOUT_S} s:\n"
                       f"{_log_tail(log_path)}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop chromium and every process of its group, and reap it (no zombie of ours). Helpers still running once
    the browser has exited (renderers, the zygote) are killed, and awaited until none runs: they are init's
    children by then, which reaps them."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_S)
    # The group keeps the browser's pid as its id while any member lives, so this reaches only chromium's helpers.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while running_in_group(proc.pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"chromium's processes {sorted(running_in_group(proc.pid))} outlived SIGKILL "
                               f"by {STOP_TIMEOUT_S} s")
        time.sleep(0.02)


def running_in_group(pgid: int) -> set[int]:
    """The pids of process group pgid's members that are not zombies (read from /proc/PID/stat, Linux's)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # After the command name's closing parenthesis: state, ppid, pgrp, ...
            state, _ppid, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        if int(pgrp) == pgid and state != "Z":
            members.add(int(entry.name))
    return members


@pytest.fixture
def browser_page(request, tmp_path) -> Iterator[Page]:
    """A Page in a fresh headless chromium for one test (skipped where chromium is missing). On teardown the
    page last opened is kept as a screenshot under build/test-artefacts/, named after the test."""
    reason = browser_missing_reason()
    if reason:
        pytest.skip(reason)
    with Browser(tmp_path) as page:
        yield page
        if page.url is not None:
            try:
                page.screenshot(artefact_path(request))
            except (CDPError, TimeoutError, OSError) as exc:  # a crashed page: the test's own failure says more
                warnings.warn(f"no screenshot of {page.url}: {exc}", stacklevel=1)
