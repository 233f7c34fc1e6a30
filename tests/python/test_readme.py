"""The README's Python example runs as written (its ```python block under "## From Python")."""

import pathlib
import re


def test_the_readme_python_example_runs(capsys):
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md (From Python)", "exec"), {})
    assert capsys.readouterr().out.startswith("values - ")
