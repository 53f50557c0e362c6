"""Every `attndbg synth` preset with every injectable mistake that applies to it, one trace each
(PRESET__KIND_MISTAKE.pt), as `attndbg synth PRESET --inject KIND:MISTAKE -o FILE` writes it, in
one process. A mistake that does not apply to a preset (its injection raises ValueError) gives no
file. bench/json_identity.sh checks them before and after a change.

    python bench/injected_traces.py OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attndbg.detectors import registry as detectors
from attndbg.replay.plans import with_engine_plan
from attndbg.trace import io, synth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for preset in synth.PRESETS:
        clean = with_engine_plan(synth.build(synth.parse_spec([preset])))
        for kind in sorted(detectors.injection_catalog()):
            try:
                trace = detectors.inject(clean, kind)
            except ValueError:
                continue  # does not apply to this preset
            io.save(trace, out / f"{preset}__{kind.replace(':', '_')}.pt")
            written += 1
    print(f"{written} injected traces in {out}")


if __name__ == "__main__":
    main()
