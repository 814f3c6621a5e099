"""``loramux tenants quota``: show, set (the other fields keep their value), lift one
with ``unlimited``, reset to the defaults; bad values refused with the quota's name. The
settings generated from ``RequestLimits`` and ``Quotas`` keep their defaults and help."""

from __future__ import annotations

import dataclasses
import json

from loramux.platform.builders import default_quotas, request_limits
from loramux.platform.cli import main
from loramux.platform.limits.request import RequestLimits
from loramux.platform.settings import Settings
from loramux.registry.quotas import Quotas


def _quota(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["tenants", "quota", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_quota_show_set_lift_reset(tmp_path, capsys):
    data = ["--data-dir", str(tmp_path / "data")]
    assert main(["tenants", "create", "acme", *data]) == 0
    assert _quota(capsys, "acme", *data)["quotas"] == Quotas().to_dict()
    out = _quota(capsys, "acme", "--requests-per-minute", "5", "--max-adapters", "2", *data)
    assert out["quotas"]["requests_per_minute"] == 5 and out["quotas"]["max_adapters"] == 2
    out = _quota(capsys, "acme", "--max-adapters", "unlimited", *data)
    assert out["quotas"]["requests_per_minute"] == 5 and out["quotas"]["max_adapters"] is None
    assert out["usage"] == {"adapters": 0, "stored_bytes": 0}
    assert _quota(capsys, "acme", "--reset", *data)["quotas"]["requests_per_minute"] is None
    assert main(["tenants", "quota", "acme", "--tokens-per-minute", "0", *data]) == 1
    assert "tokens_per_minute" in capsys.readouterr().err


def test_limit_settings_come_from_the_dataclasses():
    s = Settings()
    assert request_limits(s) == RequestLimits() and default_quotas(s) == Quotas()
    for f in dataclasses.fields(RequestLimits):
        assert Settings.model_fields[f.name].description, f.name
    s = Settings(max_stop=3, default_requests_per_minute=7, trust_request_chat_template=True)
    assert request_limits(s).max_stop == 3 and request_limits(s).trust_request_chat_template
    assert default_quotas(s).requests_per_minute == 7
