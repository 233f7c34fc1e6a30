"""The README's Python examples run as written (the ```python blocks under
"## From Python"): the NumPy one always, the PyTorch one where torch is installed."""

import importlib.util
import pathlib
import re

import pytest


def blocks():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## From Python", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(found) == 2
    return found


def test_the_readme_numpy_example_runs(capsys):
    exec(compile(blocks()[0], "README.md (From Python)", "exec"), {})
    assert capsys.readouterr().out.startswith("values - ")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_the_readme_torch_example_runs():
    namespace = {}
    exec(compile(blocks()[1], "README.md (From Python, PyTorch)", "exec"), namespace)
    assert namespace["q"].grad is not None and namespace["layer"].angles.grad is not None
