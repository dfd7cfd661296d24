"""Shell sessions in the manual's pages, checked as doctests check Python.

A session is every ```console block of a page: a line ``$ fusuma ARGS`` is a command,
the lines after it (up to the next command or the block's end) its standard output.
A test runs each command against a real host and compares the output loosely, for its
structure and words, not for what changes from run to run:

- every number (a pid, a size, a time, a version's digits) matches any number, and so
  does an age as kubectl prints it (``12s``, ``4m3s``, ``2h``);
- runs of spaces match any run of spaces (table columns move with their widths);
- a line ``...`` matches any lines, none included (output that varies in length).

``FUSUMA_DOCS_RECORD=1`` makes the test write what the commands printed back into the
page instead of comparing (after a change that alters the output on purpose).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROMPT = "$ "
ANY = "..."
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_AGE = re.compile(r"\b(?:\d+[smhd])+\b")
_FENCE = re.compile(r"^```console\s*$")


@dataclass
class Step:
    command: str
    expected: list[str] = field(default_factory=list)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command)


def parse(text: str) -> list[Step]:
    """The commands of a page's console blocks with the output shown after each."""
    steps: list[Step] = []
    inside = False
    for line in text.splitlines():
        if not inside:
            inside = bool(_FENCE.match(line))
            continue
        if line.startswith("```"):
            inside = False
            continue
        if line.startswith(PROMPT):
            steps.append(Step(line[len(PROMPT):].strip()))
        elif steps:
            steps[-1].expected.append(line)
        elif line.strip():
            raise ValueError(f"output before the first command in a console block: {line!r}")
    return steps


_TITLED = re.compile(r'^```\w+\s+title="([^"]+)"\s*$')


def files(text: str) -> dict[str, str]:
    """The files a page shows for its session to use: each code block with a title
    (```yaml title="web0.yaml"), by its title."""
    out: dict[str, str] = {}
    name: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        if name is None:
            m = _TITLED.match(line)
            if m:
                name, body = m.group(1), []
            continue
        if line.startswith("```"):
            out[name] = "\n".join(body) + "\n"
            name = None
            continue
        body.append(line)
    return out


def normal(line: str) -> str:
    return " ".join(_NUMBER.sub("N", _AGE.sub("0", line)).split())


def matches(expected: list[str], actual: list[str]) -> bool:
    """Do the actual lines have the expected ones' structure (see the module's doc)?"""
    exp = [normal(x) for x in expected]
    act = [normal(x) for x in actual]
    while exp and not exp[-1]:
        exp.pop()
    while act and not act[-1]:
        act.pop()

    def go(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i] == ANY:
            return any(go(i + 1, k) for k in range(j, len(act) + 1))
        return j < len(act) and exp[i] == act[j] and go(i + 1, j + 1)

    return go(0, 0)


def render(steps: list[tuple[str, str]]) -> str:
    """A transcript in the page's form: ``$ command`` lines, each with its output."""
    out = []
    for command, output in steps:
        out.append(PROMPT + command)
        out += output.rstrip("\n").splitlines()
    return "\n".join(out)


def record(page: Path, outputs: list[str]) -> None:
    """Write each command's real output into the page in place of the one shown."""
    lines = page.read_text().splitlines()
    result: list[str] = []
    inside, k, skipping = False, 0, False
    for line in lines:
        if not inside:
            result.append(line)
            inside = bool(_FENCE.match(line))
            continue
        if line.startswith("```"):
            inside, skipping = False, False
            result.append(line)
            continue
        if line.startswith(PROMPT):
            result.append(line)
            result += outputs[k].rstrip("\n").splitlines()
            k += 1
            skipping = True
            continue
        if not skipping:
            result.append(line)
    page.write_text("\n".join(result) + "\n")


Run = Callable[[Step], tuple[int, str, str]]


def check_page(page: Path, run: Run, min_steps: int) -> None:
    """Run every command of ``page``'s session with ``run`` (which returns the exit
    code, standard output and standard error) and compare each output with the page's;
    with ``FUSUMA_DOCS_RECORD=1`` write the real outputs into the page instead. Every
    command must succeed: a tutorial shows no failing command."""
    steps = parse(page.read_text())
    assert len(steps) >= min_steps, f"{page.name}'s session is missing"
    outputs: list[str] = []
    mismatches: list[str] = []
    for step in steps:
        code, out, err = run(step)
        assert code == 0, f"`{step.command}` exited {code} in {page.name}:\n{out}\n{err}"
        outputs.append(out)
        if not matches(step.expected, out.splitlines()):
            mismatches.append(f"`{step.command}` printed:\n{out}\n"
                              f"the page shows:\n" + "\n".join(step.expected))
    if os.environ.get("FUSUMA_DOCS_RECORD") == "1":
        record(page, outputs)
        return
    assert not mismatches, (
        f"{page.name}'s output differs from what the commands print now (rerun with "
        "FUSUMA_DOCS_RECORD=1 to write it into the page if the change is meant):\n\n"
        + "\n\n".join(mismatches))
