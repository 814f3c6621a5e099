"""EngineKey: the engine's name of one adapter version, written once and read back."""

from __future__ import annotations

import pytest

from loramux.platform.identity import STATIC_OWNER, Caller, EngineKey


def test_engine_key_round_trips_and_keeps_twelve_digest_characters():
    key = EngineKey.of(7, "sql-lora", "ab" * 32)
    assert str(key) == "7/sql-lora@" + "ab" * 6
    assert EngineKey.parse(str(key)) == key
    assert key.tenant_id == 7


def test_static_key_has_no_tenant_and_odd_names_round_trip():
    # --lora-modules names are the operator's: '/' and '@' inside them still parse back
    key = EngineKey.of(STATIC_OWNER, "team/a@b", "0123456789abcdef")
    assert EngineKey.parse(str(key)) == key
    assert key.name == "team/a@b" and key.tenant_id is None


@pytest.mark.parametrize("text", ["", "plain", "7/name", "7@digest", "/name@d", "7/@d", "7/name@"])
def test_parse_refuses_what_is_not_a_key(text):
    with pytest.raises(ValueError):
        EngineKey.parse(text)


def test_for_handle_uses_the_content_digest():
    class Handle:
        tenant_id, name, cache_key = 3, "arch", "f" * 64

    assert str(EngineKey.for_handle(Handle())) == "3/arch@" + "f" * 12


def test_caller_tenant_id():
    class Tenant:
        id, name = 5, "acme"

    assert Caller(Tenant()).tenant_id == 5 and Caller().tenant_id is None
