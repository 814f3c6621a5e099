"""The dashboard in a real browser: Playwright driving Debian's headless ``chromium``
against a live server (tiny model, ``max_loras`` 2). Log in; see the demo adapter; a
request makes it resident; evict it from the page; pin it and show that a burst over
more adapters than ``max_loras`` never evicts it; see the events in the audit view.
Then ``loramux admin`` against the same server. Screenshots: ``tests/artifacts/``."""

from __future__ import annotations

import concurrent.futures
import shutil
from pathlib import Path

import httpx
import pytest
from support.platform_settings import ADMIN_KEY, settings
from support.server import serve_in_thread
from support.services import require_service

from loramux.platform.app import create_app
from loramux.platform.cli import main as cli_main

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
TIMEOUT_MS = 15_000

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def live(env):
    app = create_app(settings(), engine=env.engine, registry=env.registry)
    with serve_in_thread(app) as url:
        yield url
    from loramux.platform.state import close_state

    close_state(app.services)


@pytest.fixture(scope="module")
def browser():
    require_service(Path(CHROMIUM).exists(), "Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


def _complete(url: str, key: str, model: str, max_tokens: int = 8) -> int:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": model, "prompt": "hello", "max_tokens": max_tokens,
                         "ignore_eos": True}, timeout=60)
    return r.status_code


def _row(page, adapter: str, tier: str | None = None) -> str:
    sel = f'tr[data-adapter="{adapter}"]'
    return sel + (f'[data-tier="{tier}"]' if tier else "")


def test_dashboard_in_browser(live, browser, env):
    ARTIFACTS.mkdir(exist_ok=True)
    events: list[tuple[str, str]] = []
    remove = env.engine.add_adapter_listener(lambda event, key: events.append((event, key)))
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(f"{live}/admin")
        assert page.url.endswith("/admin/login")
        page.fill("#key", ADMIN_KEY)
        page.click("#login")
        page.wait_for_selector("section.engine")
        assert ADMIN_KEY not in page.url
        cookie = next(c for c in page.context.cookies() if c["name"] == "loramux_admin")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

        env.registry.set_chat(env.tenant_a.id, "sql-lora", tool_call_parser="hermes")
        page.click("text=Adapters")
        page.wait_for_selector(_row(page, "sql-lora", "store"))
        chat = page.inner_text('tr[data-release="alpha/sql-lora"] .chat')
        assert "tools: hermes" in chat and "template: server's" in chat, chat
        assert _complete(live, env.key_a, "sql-lora") == 200
        page.wait_for_selector(_row(page, "sql-lora", "device"))  # live refresh
        page.screenshot(path=ARTIFACTS / "admin-resident.png", full_page=True)

        page.click(f'{_row(page, "sql-lora")} button[data-act="evict"]')
        page.wait_for_selector(_row(page, "sql-lora", "cpu"))
        assert "evict" in page.inner_text("#flash")

        page.click(f'{_row(page, "sql-lora")} button[data-act="pin"]')
        page.wait_for_selector(f'{_row(page, "sql-lora", "device")} td.pinned:has-text("pinned")')
        key = page.get_attribute(_row(page, "sql-lora"), "data-key")
        events.clear()
        models = ["a-only", "b-only", "sql-lora"] * 4
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(
                lambda m: _complete(live, env.key_b if m == "b-only" else env.key_a, m), models))
        assert codes == [200] * len(models)
        evicted = {k for e, k in events if e == "evicted"}
        assert evicted and key not in evicted  # the others took turns in the free slot
        for other in ("a-only", "b-only"):  # the next refresh shows the burst
            page.wait_for_selector(f'{_row(page, other)}:not([data-tier="store"])')
        assert page.get_attribute(_row(page, "sql-lora"), "data-tier") == "device"
        page.screenshot(path=ARTIFACTS / "admin-adapters.png", full_page=True)

        page.click("text=Audit")
        page.wait_for_selector('#audit tr[data-kind="pinned"]')
        page.wait_for_selector('#audit tr[data-kind="evicted"]')
        assert "sql-lora" in page.inner_text("#audit")
        page.screenshot(path=ARTIFACTS / "admin-audit.png", full_page=True)
        page.click("text=Tenants")
        page.wait_for_selector('section.tenant[data-tenant="alpha"]')
        page.screenshot(path=ARTIFACTS / "admin-tenants.png", full_page=True)
        page.click("text=Overview")
        page.wait_for_selector("section.engine")
        page.screenshot(path=ARTIFACTS / "admin-overview.png", full_page=True)
    finally:
        remove()
        page.close()


def test_admin_cli(live, env, capsys, monkeypatch):
    monkeypatch.setenv("LORAMUX_ADMIN_KEY", ADMIN_KEY)
    assert cli_main(["admin", "warm", "a-only", "--tenant", "alpha", "--url", live]) == 0
    assert "warm" in capsys.readouterr().out
    assert cli_main(["admin", "pin", "a-only", "--tenant", "alpha", "--url", live]) == 0
    assert cli_main(["admin", "adapters", "--url", live]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if " a-only " in x)
    assert "alpha" in line and " yes " in line
    assert cli_main(["admin", "unpin", "a-only", "--tenant", "alpha", "--url", live]) == 0
    assert cli_main(["admin", "evict", "a-only", "--tenant", "alpha", "--url", live]) == 0
    assert "evict" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="403"):
        cli_main(["admin", "adapters", "--url", live, "--admin-key", env.key_a])
    assert cli_main(["admin", "pin", "nope", "--tenant", "alpha", "--url", live]) == 1
