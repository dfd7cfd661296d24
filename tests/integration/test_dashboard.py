"""The web dashboard in a real browser: Playwright driving Debian's chromium against a
real `fusuma serve` (HTTPS, login with a token) and real VMs.

The page must list what `fusuma ps` lists, follow a move clicked in it (the event with
its downtime, the row's new partition, no reload), show a stop made from the CLI within
2 s, show a refused action's sentence, log no console error, fit 1280 and 390 px without
horizontal overflow, and give nothing without a token. The screenshots in docs/ are
taken here."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, ViewportSize, expect, sync_playwright

from tests.apikit import Api
from tests.conftest import REPO, Host

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update"]
WIDE: ViewportSize = {"width": 1280, "height": 800}
PHONE: ViewportSize = {"width": 390, "height": 844}
# Screenshots land in test-output/; the docs' copies are refreshed only when asked
# (FUSUMA_UPDATE_DOCS=1), so that a test run leaves the work tree as it found it.
SHOTS = REPO / "test-output"
DOCS = REPO / "docs"
# p1's budget holds its supervisor (64 MiB) and one VM's QEMU (96 MiB under KVM, 128
# under TCG; guest RAM is admitted host-wide), but not a second QEMU: a full partition
# to move into.
FULL_MIB = "250"


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Console:
    """Console errors and uncaught exceptions of a page. A refused action's HTTP status
    is logged by Chromium itself ("Failed to load resource: ... 409"); the test names
    the refusals it provokes, and only those are let through."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        self.expected: list[tuple[int, str]] = []
        self.allowed: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type != "error":
            return
        url = str(msg.location.get("url", ""))
        for status, path in self.expected:
            if f"status of {status}" in msg.text and url.endswith(path):
                self.allowed.append(msg.text)
                return
        self.errors.append(f"{msg.text} ({url})")


def login(page: Page, url: str, token: str) -> None:
    page.goto(url + "/")
    expect(page).to_have_url(url + "/login")
    page.fill("#token", token)
    page.click("#login-submit")
    expect(page).to_have_url(url + "/")


def shot(page: Page, name: str) -> None:
    """A full-page screenshot into test-output/ (and the docs' copy when asked)."""
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / name), full_page=True)
    assert (SHOTS / name).stat().st_size > 0
    if os.environ.get("FUSUMA_UPDATE_DOCS") == "1":
        shutil.copyfile(SHOTS / name, DOCS / name)


def no_overflow(page: Page) -> None:
    sw, iw = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert sw <= iw, f"the page is {sw} px wide in a {iw} px window"


def rows(page: Page, table: str, attr: str) -> list[str]:
    got: list[str] = page.eval_on_selector_all(
        f"#{table} tbody tr[{attr}]", f"rs => rs.map(r => r.getAttribute('{attr}'))")
    return got


def shown_ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+) ms", text.strip())
    assert m, text
    return float(m.group(1))


def png(path: Path, w: int = 4, h: int = 3) -> None:
    """A small valid PNG (grey), for a report's plot."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    raw = b"".join(b"\x00" + b"\x80" * w for _ in range(h))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0,
                                                                       0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


# -- the page with real VMs ----------------------------------------------------------
def test_dashboard_live(host: Host) -> None:
    host.run("partition", "create", "p0", "--cpus", host.core(0), "--memory", "1024")
    host.run("partition", "create", "p1", "--cpus", host.core(1), "--memory", FULL_MIB)
    host.run("vm", "create", "v0", "-p", "p0", "--memory", "128", "--start")
    # v1 is guaranteed, so the governor has something to decide and show.
    host.run("vm", "create", "v1", "-p", "p1", "--memory", "128", "--qos", "guaranteed",
             "--start")
    # Admin: the page's every action is offered (resize is admin's).
    token = host.run("token", "create", "ui", "--role", "admin", "--json").json()["token"]
    api = Api(host, listen=True)
    try:
        assert api.url
        with chromium() as browser:
            ctx = browser.new_context(ignore_https_errors=True, viewport=WIDE)
            page = ctx.new_page()
            console = Console(page)
            navigations: list[str] = []
            login(page, api.url, token)
            page.on("framenavigated", lambda f: navigations.append(f.url)
                    if f == page.main_frame else None)
            page.evaluate("window.__loadedOnce = 'yes'")
            _lists_what_ps_lists(host, page)

            # The screenshots, once both VMs have CPU samples to draw.
            page.wait_for_selector('tr[data-vm="v1"] svg.spark.cpu polyline', timeout=20000)
            expect(page.locator("#live")).to_have_attribute("data-live", "live")
            no_overflow(page)
            shot(page, "dashboard-1280.png")
            page.set_viewport_size(PHONE)
            expect(page.locator('#vms tr[data-vm="v0"] td').first).to_have_css(
                "display", "flex")
            no_overflow(page)
            shot(page, "dashboard-390.png")
            page.set_viewport_size(WIDE)

            _refused_move(api, token, page, console)
            _move_clicked(host, api, page)
            _stop_from_cli(host, page)
            _start_stop_resize_clicked(host, page)

            for size in (WIDE, PHONE):
                page.set_viewport_size(size)
                page.wait_for_timeout(200)
                no_overflow(page)
            assert page.evaluate("window.__loadedOnce") == "yes", "the page was reloaded"
            assert navigations == [], f"the page navigated: {navigations}"
            assert console.errors == [], console.errors
    finally:
        api.stop()


def _lists_what_ps_lists(host: Host, page: Page) -> None:
    ps = host.ps()
    expect(page.locator("#vms tbody tr[data-vm]")).to_have_count(len(ps["vms"]))
    for v in ps["vms"]:
        row = page.locator(f'#vms tr[data-vm="{v["name"]}"]')
        expect(row).to_have_attribute("data-partition", v["partition"])
        expect(row.locator(".vm-state")).to_have_text(v["state"])
        expect(row.locator(".vm-partition")).to_have_text(v["partition"])
    assert sorted(rows(page, "partitions", "data-partition")) == sorted(
        p["name"] for p in ps["partitions"])
    for p in ps["partitions"]:
        row = page.locator(f'#partitions tr[data-partition="{p["name"]}"]')
        expect(row.locator(".badge")).to_have_text(p["state"])
        expect(row.locator("td").nth(1)).to_have_text(",".join(map(str, p["cpus"])))
        expect(row).to_contain_text(f"/ {p['memory_mib']} MiB")
        # Every core of the partition is a tile of its colour with its name on it.
        for core in p["cpus"]:
            tile = page.locator(f'#coremap .core[data-core="{core}"]')
            expect(tile).to_have_attribute("data-partition", p["name"])
            expect(tile).to_contain_text(f"partition {p['name']}")
    expect(page.locator("#ksm-risk")).to_contain_text("side channel")


def _refused_move(api: Api, token: str, page: Page, console: Console) -> None:
    """v0 into p1, which has no room: the page says the API's sentence."""
    console.expected.append((409, "/1.0/vms/v0/move"))
    row = page.locator('#vms tr[data-vm="v0"]')
    row.locator("select.move-to").select_option("p1")
    row.locator("button.act-move").click()
    toast = page.locator(".toast-error").filter(has_text="no room for 'v0'")
    expect(toast).to_be_visible(timeout=10000)
    with api.tcp(token) as c:
        r = c.post("/1.0/vms/v0/move", json={"partition": "p1"})
    assert r.status_code == 409, r.text
    expect(toast).to_contain_text(r.json()["error"])
    assert "Traceback" not in toast.inner_text()
    expect(row).to_have_attribute("data-partition", "p0")
    assert len(console.allowed) == 1, console.allowed      # the page did ask the API
    toast.locator(".toast-close").click()


def _move_clicked(host: Host, api: Api, page: Page) -> None:
    """v1 into p0 by a click: the row follows and the event shows the downtime."""
    row = page.locator('#vms tr[data-vm="v1"]')
    with api.events("lifecycle") as events:
        row.locator("select.move-to").select_option("p0")
        row.locator("button.act-move").click()
        expect(row).to_have_attribute("data-partition", "p0", timeout=90000)
        expect(row.locator(".vm-partition")).to_have_text("p0")
        item = page.locator('#events li[data-action="vm-moved"]').filter(has_text="v1 moved")
        expect(item).to_have_count(1, timeout=10000)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
                e["metadata"]["action"] == "vm-moved" for e in events):
            time.sleep(0.05)
    moved: dict[str, Any] = next(e for e in events if e["metadata"]["action"] == "vm-moved")
    c = moved["metadata"]["context"]
    assert (c["vm"], c["from"], c["to"]) == ("v1", "p1", "p0"), c
    expect(item).to_contain_text("p1 → p0")
    assert abs(shown_ms(item.locator(".ev-downtime").inner_text()) - c["downtime_ms"]) <= 0.5
    expect(item.locator(".ev-bytes")).to_have_text(re.compile(r"[\d.]+ (B|KiB|MiB|GiB)"))
    expect(item).to_contain_text("sent")
    # The action's own result says it too.
    expect(page.locator(".toast-ok").filter(has_text="v1 moved p1 → p0")).to_contain_text(
        "downtime")
    expect(page.locator(f'#coremap .core[data-core="{host.core(0)}"]')).to_contain_text(
        "v1/0", timeout=5000)


def _stop_from_cli(host: Host, page: Page) -> None:
    row = page.locator('#vms tr[data-vm="v0"]')
    expect(row).to_have_attribute("data-state", "running")
    host.run("vm", "stop", "v0")
    expect(row).to_have_attribute("data-state", "stopped", timeout=2000)
    expect(row.locator(".vm-state")).to_have_text("stopped")
    expect(row.locator("button.act-start")).to_be_enabled()


def _start_stop_resize_clicked(host: Host, page: Page) -> None:
    """The other actions from the page: start, stop (asks for a second click), resize."""
    row = page.locator('#vms tr[data-vm="v0"]')
    row.locator("button.act-start").click()
    expect(row).to_have_attribute("data-state", "running", timeout=60000)
    assert host.vm("v0")["state"] == "running"
    stop = row.locator("button.act-stop")
    stop.click()
    expect(stop).to_have_text("Stop v0?")
    assert host.vm("v0")["state"] == "running"          # one click only asks
    stop.click()
    expect(row).to_have_attribute("data-state", "stopped", timeout=30000)
    assert host.vm("v0")["state"] == "stopped"

    part = page.locator('#partitions tr[data-partition="p1"]')
    part.locator("button.act-resize").click()
    expect(page.locator("#resize-dialog")).to_be_visible()
    page.fill("#resize-memory", "448")
    page.click("#resize-ok")
    expect(part).to_contain_text("/ 448 MiB", timeout=30000)
    assert host.part("p1")["memory_mib"] == 448


# -- login, no data without it, results, logout -----------------------------------------
def test_dashboard_login(host: Host, tmp_path: Path) -> None:
    report = tmp_path / "results" / "demo-report"
    report.mkdir(parents=True)
    (report / "report.md").write_text("# Demo report\n\n| vms | pss_mib |\n|---|---|\n"
                                      "| 1 | 180 |\n\n![memory](demo.png)\n")
    png(report / "demo.png")
    token = host.run("token", "create", "ui", "--role", "viewer", "--json").json()["token"]
    api = Api(host, listen=True, env={"FUSUMA_RESULTS_DIR": str(tmp_path / "results")})
    try:
        assert api.url
        with api.tcp(None) as c:
            r = c.get("/1.0/ui/state")
            assert r.status_code == 401, r.text
            assert "partitions" not in r.text and "vms" not in r.text
            r = c.get("/")
            assert (r.status_code, r.headers["location"]) == (303, "/login")
        with chromium() as browser:
            ctx = browser.new_context(ignore_https_errors=True, viewport=WIDE)
            page = ctx.new_page()
            console = Console(page)
            page.goto(api.url + "/")
            expect(page).to_have_url(api.url + "/login")
            expect(page.locator("#token")).to_be_visible()
            assert page.locator("#vms").count() == 0
            assert page.request.get(api.url + "/1.0/ui/state").status == 401
            no_overflow(page)

            page.fill("#token", "fsm_not-a-token")
            page.click("#login-submit")
            expect(page.locator("#login-error")).to_contain_text("not valid")
            assert page.request.get(api.url + "/1.0/ui/state").status == 401

            login(page, api.url, token)
            expect(page.locator("#partitions tbody")).to_contain_text("No partitions yet")
            expect(page.locator("#role")).to_have_text("viewer")
            assert page.request.get(api.url + "/1.0/ui/state").status == 200

            page.click("text=Results")
            expect(page).to_have_url(api.url + "/ui/results")
            page.click("#reports >> text=demo-report")
            expect(page.locator("#report h1")).to_have_text("Demo report")
            expect(page.locator("#report table")).to_contain_text("pss_mib")
            img = page.locator("#report img")
            expect(img).to_have_attribute("src", "/ui/results/demo-report/demo.png")
            expect(img).to_have_js_property("naturalWidth", 4)      # the plot loaded

            page.goto(api.url + "/")
            # Log out once the page's event stream is open: a stream still connecting
            # when the session ends is refused (401), rightly.
            expect(page.locator("#live")).to_have_attribute("data-live", "live")
            page.click("#logout")
            expect(page).to_have_url(api.url + "/login")
            page.goto(api.url + "/")
            expect(page).to_have_url(api.url + "/login")
            assert page.request.get(api.url + "/1.0/ui/state").status == 401
            assert console.errors == [], console.errors
    finally:
        api.stop()
