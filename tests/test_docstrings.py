"""The examples in bnbf's and bnbf_nn's docstrings run as written: doctest over each module of either package whose
source holds one (a ``>>>`` line), in the module's namespace (doctest's own rule: what an example uses and the module
does not define or import, the example imports), on the CPU."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

import bnbf
import bnbf_nn

MODULES = sorted(
    ".".join((package.__name__, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    for package in (bnbf, bnbf_nn)
    for root in [pathlib.Path(package.__file__).parent]
    for path in root.rglob("*.py")
    if ">>>" in path.read_text()
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    # every '>>>' line of the source is an example doctest finds (not one in a docstring it does not collect, such
    # as a nested function's, which would never run)
    prompts = len(re.findall(r"^\s*>>>", pathlib.Path(module.__file__).read_text(), re.MULTILINE))
    assert sum(len(t.examples) for t in tests) == prompts, f"{name}: examples doctest does not find"
    runner = doctest.DocTestRunner()
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def test_the_modules_with_examples_are_found():
    """The discovery above finds the modules that hold examples (a check of its path arithmetic)."""
    assert {"bnbf", "bnbf.functional", "bnbf.packed", "bnbf.compose", "bnbf.rules"} <= set(MODULES)
    assert {"bnbf_nn", "bnbf_nn.nn", "bnbf_nn.optim"} <= set(MODULES)
