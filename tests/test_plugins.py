"""plugins.load: the one import of a "pkg.module:attr" string, for the backend registry, the detector
registry and a Detector's hooks named by string."""

from __future__ import annotations

import pytest

from attndbg import plugins
from attndbg.backends import registry
from attndbg.backends.reference import ReferenceBackend
from attndbg.detectors import registry as detectors
from attndbg.detectors.base import Detector


def test_load_imports_the_attribute_a_target_names() -> None:
    assert plugins.load("attndbg.backends.reference:ReferenceBackend") is ReferenceBackend
    assert isinstance(plugins.load("attndbg.detectors.batch_invariance:DETECTOR"), Detector)


@pytest.mark.parametrize(
    ("target", "error", "needle"),
    [
        ("no_such_module_here.adapter:Cls", ImportError, "No module named 'no_such_module_here'"),
        ("attndbg.plugins:Nope", AttributeError, "module 'attndbg.plugins' has no attribute 'Nope'"),
        ("attndbg.plugins", AttributeError, "'attndbg.plugins' names no attribute: expected pkg.module:attr"),
        ("attndbg.plugins:", AttributeError, "names no attribute"),
    ],
)
def test_load_says_what_it_could_not_import(target: str, error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        plugins.load(target)


def test_both_registries_load_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", "plain=attndbg.backends.reference:ReferenceBackend,gone=attndbg.plugins:Nope")
    assert registry.adapter_class("plain") is ReferenceBackend
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        registry.adapter_class("gone")
    monkeypatch.setenv("ATTNDBG_DETECTORS", "toy=attndbg.plugins:Nope")
    with pytest.raises(detectors.LoadError, match=r"detector 'toy': cannot load attndbg.plugins:Nope \(AttributeError: module 'attndbg.plugins' has no attribute 'Nope'\)"):
        detectors.load("toy")
