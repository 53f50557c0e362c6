"""docs/checking.md's detector and injection tables are the registry's: a detector added, renamed
or re-summarised there must be so in the checking page too."""

from __future__ import annotations

from pathlib import Path

from attndbg.detectors import registry
from attndbg.detectors.catalog import injection_lines

CHECKING = Path(__file__).resolve().parents[2] / "docs" / "checking.md"


def detector_tables() -> str:
    """The two tables as the checking page shows them, from the built-in detectors (no third party's)."""
    rows = ["| detector (`check --only`) | what it judges | mistakes it finds (`synth --inject`) |", "|---|---|---|"]
    injections = ["| mistake (`synth --inject`) | what it plants |", "|---|---|"]
    for kind in registry.BUILTIN:
        detector = registry.load(kind)
        lines = injection_lines(detector)
        mistakes = ", ".join(f"`{k.partition(':')[2]}`" for k in lines)
        rows.append(f"| `{detector.name}` | {detector.summary} | {mistakes} |")
        injections += [f"| `{k}` | {line} |" for k, line in lines.items()]
    return "\n".join(rows) + "\n\n" + "\n".join(injections) + "\n"


def test_checking_page_tables_are_the_registry(monkeypatch) -> None:
    monkeypatch.delenv(registry.ENVIRONMENT.variable, raising=False)
    expected = detector_tables()
    assert expected in CHECKING.read_text(encoding="utf-8"), "docs/checking.md's detector tables differ from the registry; they should read:\n\n" + expected


def test_checking_page_names_every_mistake_model() -> None:
    from attndbg.diagnose import MODELS

    text = CHECKING.read_text(encoding="utf-8")
    assert [m.name for m in MODELS if f"`{m.name}`" not in text] == []
