"""The environment is input too: a malformed ATTNDBG_BACKENDS is one line and exit 2, never a traceback."""

from __future__ import annotations

import pytest

from tests.cli.helpers import invoke, one_line_error


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("bad", "ATTNDBG_BACKENDS: expected NAME=pkg.module:Class, got 'bad'"),
        ("x=pkg_without_class", "ATTNDBG_BACKENDS: expected NAME=pkg.module:Class, got 'x=pkg_without_class'"),
        ("x=no_such_module_here.adapter:Cls", "backend 'x' names module 'no_such_module_here.adapter', which cannot be found"),
    ],
)
def test_a_malformed_backend_registration_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str, needle: str) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", value)
    one_line_error(invoke("backends"), needle)


def test_a_registered_adapter_is_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", "plain=attndbg.backends.reference:ReferenceBackend")
    result = invoke("backends")
    assert result.exit_code == 0, result.output
    assert "plain" in result.output
