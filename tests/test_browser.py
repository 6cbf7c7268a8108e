"""The headless-browser harness (tests/browser.py) itself: it sees what a clean page shows, and it reports what
breaks a page (console errors, uncaught exceptions, an image that fails to load, a hidden element)."""

from __future__ import annotations

import base64
import os
import socket
import struct
import zlib
from pathlib import Path

import pytest

import browser
from browser import Browser, artefact_path, find_chromium

pytestmark = [pytest.mark.browser]

#: The eight bytes every PNG file starts with.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour, built by hand (signature, IHDR, IDAT, IEND) so the test needs no imaging library."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))  # filter byte 0 per row
    return (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which must come first after the signature."""
    assert data[:8] == PNG_SIGNATURE, data[:8]
    assert data[12:16] == b"IHDR", data[12:16]
    return struct.unpack(">II", data[16:24])


def _page(tmp_path: Path, body: str, name: str = "page.html") -> Path:
    path = tmp_path / name
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>t</title></head>"
                    f"<body>{body}</body></html>")
    return path


CLEAN_BODY = f"""
<table id="t"><tr><th>plan</th><th>step time</th></tr><tr><td>dp8</td><td>1.2 s</td></tr></table>
<img id="dot" alt="dot" src="data:image/png;base64,{base64.b64encode(_png(6, 4, (200, 30, 30))).decode()}">
<svg id="chart" width="120" height="60" xmlns="http://www.w3.org/2000/svg">
  <rect x="10" y="10" width="100" height="40" fill="steelblue"/></svg>
"""


def test_hand_made_png_reads_back():
    """The helpers the other tests rely on agree with each other."""
    assert _png_size(_png(6, 4, (0, 0, 0))) == (6, 4)


def test_clean_page_has_no_errors_and_shows_its_elements(browser_page, tmp_path, request):
    browser_page.open(_page(tmp_path, CLEAN_BODY))
    assert browser_page.errors == []
    (table,) = browser_page.visible("#t")
    assert table["visible"] and table["width"] > 0 and table["height"] > 0
    (image,) = browser_page.visible("img")
    assert image["visible"] and image["complete"]
    assert (image["natural_width"], image["natural_height"]) == (6, 4)
    (svg,) = browser_page.visible("svg")
    assert svg["visible"] and (svg["width"], svg["height"]) == (120, 60)
    assert (svg["content_width"], svg["content_height"]) == (100, 40)
    assert browser_page.evaluate("document.querySelectorAll('td').length") == 2
    assert browser_page.evaluate("Promise.resolve({a: [1, 'x']})") == {"a": [1, "x"]}

    shot = browser_page.screenshot(artefact_path(request))
    assert shot.parent == browser.ARTEFACTS and shot.name.endswith(".png") and "clean_page" in shot.name
    width, height = _png_size(shot.read_bytes())
    assert width > 0 and height > 0


def test_full_page_screenshot_covers_a_page_taller_than_the_window(browser_page, tmp_path):
    tall = browser.WINDOW_SIZE[1] * 3
    browser_page.open(_page(tmp_path, f"<div style='height:{tall}px;background:#eee'>tall</div>"))
    window = browser_page.evaluate("[window.innerWidth, window.innerHeight]")
    assert window[1] < tall
    width, height = _png_size(browser_page.screenshot(tmp_path / "tall.png").read_bytes())
    assert width == window[0]
    assert height >= tall
    # The window is set back afterwards.
    assert browser_page.evaluate("[window.innerWidth, window.innerHeight]") == window


def test_console_error_and_failed_assert_are_reported(browser_page, tmp_path):
    browser_page.open(_page(tmp_path, "<script>console.error('x', 42); console.assert(1 === 2, 'unequal');"
                                      "console.log('fine'); console.warn('also fine')</script>"))
    errors = browser_page.errors
    assert len(errors) == 2, errors
    assert errors[0].startswith("console.error: x 42 (file://") and "page.html:1" in errors[0]
    assert errors[1].startswith("console.assert: unequal")


def test_uncaught_exception_is_reported(browser_page, tmp_path):
    browser_page.open(_page(tmp_path, "<p>before</p><script>throw new TypeError('boom')</script>"))
    (error,) = browser_page.errors
    assert error.startswith("uncaught exception: TypeError: boom (file://"), error


def test_rejected_promise_is_reported(browser_page, tmp_path):
    browser_page.open(_page(tmp_path, "<script>Promise.reject(new Error('late'))</script>"))
    (error,) = browser_page.errors
    assert "uncaught exception" in error and "late" in error, error


def test_missing_image_is_reported_and_has_no_natural_width(browser_page, tmp_path):
    browser_page.open(_page(tmp_path, "<img id='broken' src='missing.png' alt='gone' width='50' height='50'>"))
    (error,) = browser_page.errors
    assert "Failed to load resource" in error and error.endswith("missing.png)"), error
    (image,) = browser_page.visible("#broken")
    assert image["complete"] and image["natural_width"] == 0


def test_undecodable_image_has_no_natural_width(browser_page, tmp_path):
    """A file that is there but is no image: the load fails in the decoder, not the network."""
    (tmp_path / "fake.png").write_bytes(b"not a png at all")
    browser_page.open(_page(tmp_path, "<img src='fake.png' alt='fake'>"))
    (image,) = browser_page.visible("img")
    assert image["complete"] and image["natural_width"] == 0


@pytest.mark.parametrize(("style", "hidden_by"), [("display:none", "display:none"),
                                                   ("visibility:hidden", "visibility:hidden"),
                                                   ("opacity:0", "opacity:0")])
def test_hidden_elements_are_not_visible(browser_page, tmp_path, style, hidden_by):
    browser_page.open(_page(tmp_path, f"<div id='outer' style='{style}'><p id='inner'>text</p></div>"
                                      "<p id='shown'>shown</p>"))
    for selector in ("#outer", "#inner"):  # the element itself, and through its ancestor
        (box,) = browser_page.visible(selector)
        assert box["hidden_by"] == hidden_by and not box["visible"], (selector, box)
    (shown,) = browser_page.visible("#shown")
    assert shown["visible"] and shown["hidden_by"] is None
    assert browser_page.visible("#absent") == []


def test_script_error_in_evaluate_raises(browser_page, tmp_path):
    browser_page.open(_page(tmp_path, "<p>x</p>"))
    with pytest.raises(browser.CDPError, match="nope"):
        browser_page.evaluate("(() => { throw new Error('nope') })()")


def test_a_page_that_never_loads_times_out_with_a_clear_error(browser_page, tmp_path):
    """An image whose request never ends holds the load event back."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        page = _page(tmp_path, f"<img src='http://127.0.0.1:{port}/never.png'>")
        with pytest.raises(TimeoutError, match="did not finish loading"):
            browser_page.open(page, timeout=2)


def _group_members(pgid: int) -> dict[int, tuple[str, int]]:
    """{pid: (state, ppid)} of the processes in process group pgid, read from /proc (independently of the
    harness's own reading)."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid:
            members[int(stat.parent.name)] = (state, int(ppid))
    return members


def _left_behind(pgid: int) -> dict[int, tuple[str, int]]:
    """Members still running, or zombies this process would have to reap (a helper's zombie is init's)."""
    return {pid: (state, ppid) for pid, (state, ppid) in _group_members(pgid).items()
            if state != "Z" or ppid == os.getpid()}


@browser.requires_chromium
def test_browser_stops_chromium_and_its_helpers(tmp_path):
    with Browser(tmp_path) as page:
        page.open(_page(tmp_path, "<p>x</p>"))
        members = _group_members(page.browser_pid)
        assert page.browser_pid in members and len(members) > 1, members  # the browser and its helpers
    assert _left_behind(page.browser_pid) == {}


@browser.requires_chromium
def test_browser_is_stopped_when_the_body_raises(tmp_path):
    with pytest.raises(KeyError), Browser(tmp_path) as page:
        pid = page.browser_pid
        raise KeyError("body failed")
    assert _left_behind(pid) == {}


def _fake_chromium(tmp_path: Path, monkeypatch, script: str) -> None:
    """Make Browser start a shell script in chromium's place."""
    fake = tmp_path / "fake-chromium"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setattr(browser, "find_chromium", lambda: str(fake))
    monkeypatch.setattr(browser, "websocket", browser.websocket or object())


def test_a_browser_that_exits_at_once_raises_with_its_output(tmp_path, monkeypatch):
    _fake_chromium(tmp_path, monkeypatch, "echo 'cannot open display: no such thing' >&2\nexit 3\n")
    with pytest.raises(RuntimeError, match=r"exited \(3\) before it listened:\ncannot open display"), \
            Browser(tmp_path):
        pass


def test_a_browser_that_never_listens_raises_and_is_stopped(tmp_path, monkeypatch):
    _fake_chromium(tmp_path, monkeypatch, "echo started >&2\necho $$ > \"$0.pid\"\nexec sleep 600\n")
    monkeypatch.setattr(browser, "START_TIMEOUT_S", 1)
    with pytest.raises(RuntimeError, match="wrote no DevToolsActivePort within 1 s:\nstarted"), Browser(tmp_path):
        pass
    pid = int((tmp_path / "fake-chromium.pid").read_text())
    assert _left_behind(pid) == {}


def test_find_chromium_names_an_executable():
    found = find_chromium()
    if found is None:
        pytest.skip(browser.browser_missing_reason())
    assert Path(found).exists()
