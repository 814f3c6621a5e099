"""Where an operator looks, the server says whether its engine runs the compiled CPU kernels:
``/ready`` (``"kernels"``, the reason for the admin only), the Prometheus gauge
``loramux_cpu_kernels_available`` and the dashboard's overview; an engine without them is
``degraded`` but serves."""

from __future__ import annotations

import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.cpu_kernel import require_cpu_kernel
from support.platform_settings import ADMIN_KEY

from loramux.engine.model.kernels import loader

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _gauge(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in the scrape")


@pytest.fixture
def without_kernels(monkeypatch):
    """The process as if the extension were missing (an image built without a compiler)."""
    monkeypatch.setattr(loader, "_loaded", False)
    monkeypatch.setattr(loader, "_error", None)
    monkeypatch.setitem(sys.modules, loader.EXTENSION, None)


async def _report(client) -> tuple[dict, dict, float, dict, str]:
    public = (await client.get("/ready")).json()
    admin = (await client.get("/ready", headers=ADMIN)).json()
    gauge = _gauge((await client.get("/metrics", headers=ADMIN)).text, "loramux_cpu_kernels_available")
    card = (await client.get("/admin/overview", headers=ADMIN)).json()["engines"][0]
    assert (await client.post("/admin/login", data={"key": ADMIN_KEY})).status_code == 303
    page = (await client.get("/admin")).text
    return public, admin, gauge, card, page


async def test_loaded_kernels_are_reported_ok(client):
    require_cpu_kernel()
    public, admin, gauge, card, page = await _report(client)
    assert public["status"] == "ready" and public["kernels"] == "ok" and public["reasons"] is None
    assert "kernels" not in (admin["reasons"] or {})
    assert gauge == 1.0
    assert card["cpu_kernels"] == "ok" and card["cpu_kernels_reason"] is None
    assert 'class="kernels "' in page and ">ok</dd>" in page


async def test_missing_kernels_are_degraded_with_the_reason_for_the_admin(client, without_kernels):
    public, admin, gauge, card, page = await _report(client)
    assert public["status"] == "degraded" and public["kernels"] == "degraded"
    assert public["reasons"] is None  # the reason may name paths: the admin's only
    assert admin["status"] == "degraded" and "not installed" in admin["reasons"]["kernels"]
    assert gauge == 0.0
    assert card["cpu_kernels"] == "degraded" and "not installed" in card["cpu_kernels_reason"]
    assert 'class="kernels err"' in page and "not installed" in page
    # degraded, not down: still in the rotation (an engine built without the kernels serves
    # on torch ops: tests/engine/test_cpu_ops.py)
    assert (await client.get("/ready")).status_code == 200
    assert (await client.get("/health")).status_code == 200


async def test_turned_off_kernels_are_disabled_and_ready(client, monkeypatch):
    monkeypatch.setenv("LORAMUX_CPU_KERNELS", "0")
    public, admin, gauge, card, _ = await _report(client)
    assert public["status"] == "ready" and public["kernels"] == "disabled"
    assert "LORAMUX_CPU_KERNELS=0" in admin["reasons"]["kernels"]
    assert gauge == 0.0 and card["cpu_kernels"] == "disabled"
