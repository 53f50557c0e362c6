"""Package discovery (the rest of the metadata is in pyproject.toml).

Packages are found, not listed, so a new subpackage ships without anyone editing this file. The
folder backends/ installs as attndbg.backends (the project keeps the kernel adapters apart from
the rest, DESIGN.md), which pyproject's `packages.find` cannot express: it finds `backends` as a
top-level package. The folder traces/ installs the same way, as the data of attndbg.examples.traces.
tests/packaging/test_wheel.py compares the wheel with every folder holding an __init__.py.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["attndbg", "attndbg.*"])
    + [f"attndbg.{name}" for name in find_packages(include=["backends", "backends.*"])]
    # Data only: the example traces, which `attndbg examples DIR` writes (attndbg/examples).
    + ["attndbg.examples.traces"],
    package_dir={"attndbg.backends": "backends", "attndbg.examples.traces": "traces"},
    package_data={
        # Read at run time, not imported: `record` puts this folder on the engine's PYTHONPATH.
        "attndbg.record": ["startup/sitecustomize.py"],
        "attndbg.examples.traces": ["*.pt"],
    },
)
