"""The naming rule matches the whole string: a trailing newline is not a name."""

from __future__ import annotations

import pytest

from loramux.registry import InvalidName
from loramux.registry.names import check_name


@pytest.mark.parametrize("name", ["a", "sql-lora", "v1.2_x", "A" * 128])
def test_good_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["sql-lora\n", "sql-lora\r\n", "a\nb", "\na", "a ", "", ".a", "a..b", "A" * 129, None, 7],
)
def test_bad_names(name):
    with pytest.raises(InvalidName, match="invalid tenant name"):
        check_name(name, "tenant")
