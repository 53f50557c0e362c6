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


def test_installed_entry_points_are_read_once_per_sys_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registries ask per step; importlib.metadata rescans every distribution on each call. A
    distribution that appears on a new sys.path entry is still found (the third-party tests install
    one so)."""
    calls = []
    real = plugins.entry_points
    monkeypatch.setattr(plugins, "entry_points", lambda **kw: calls.append(kw) or real(**kw))
    plugins._installed.cache_clear()
    group = "attndbg.test_group_nobody_declares"
    assert plugins.installed(group) == ()
    assert plugins.installed(group) == ()
    assert len(calls) == 1

    info = tmp_path / "toy_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[{group}]\ntoy = toy_plugin:THING\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [ep.name for ep in plugins.installed(group)] == ["toy"]
    assert len(calls) == 2
