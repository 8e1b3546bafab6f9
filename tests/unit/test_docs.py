"""The documentation cannot drift from the code: docs/options.md is what the command line generates, every
training flag is in it, the README stays a front door, and every relative link leads somewhere."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from ddp_amp.commands.options import option_specs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_options", DOCS / "generate_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_options_reference_is_what_the_code_generates():
    """A field's docstring, default or choices changed without `make docs` fails here."""
    assert (DOCS / "options.md").read_text() == _generator().options_reference(), \
        "docs/options.md is stale: run `make docs`"


def test_every_training_flag_is_in_the_options_reference():
    page = (DOCS / "options.md").read_text()
    missing = [spec.flag for spec in option_specs() if f"| `{spec.flag}`" not in page]
    assert not missing, missing


def test_a_changed_help_changes_the_reference(monkeypatch):
    """What the staleness test relies on: the page is made from the help the flags carry (for a training option,
    its TrainConfig docstring: tests/unit/test_cli.py), so it follows them."""
    generator = _generator()
    before = generator.options_reference()
    from ddp_amp.cli import app

    command = generator.typer.main.get_command(app)
    task = next(p for p in command.commands["spawn"].params if "--task" in getattr(p, "opts", ()))
    original = task.help

    monkeypatch.setattr(generator.typer.main, "get_command", lambda _: command)
    monkeypatch.setattr(task, "help", original + " Changed.")
    assert generator.options_reference() != before


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines: move the detail to a page in docs/"


PAGES = [*sorted(ROOT.glob("*.md")), *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_leads_to_a_file_that_exists(page):
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    broken = [link for link in links if "://" not in link and not link.startswith(("#", "mailto:"))
              and not (page.parent / link.split("#")[0]).exists()]
    assert not broken, broken


def test_the_task_snippet_in_models_md_lists_every_field_of_task():
    import dataclasses

    from ddp_amp.tasks import Task

    snippet = (DOCS / "models.md").read_text().split("```python", 1)[1].split("```", 1)[0]
    assert [f.name for f in dataclasses.fields(Task) if f"{f.name}=" not in snippet] == []


def _sections(page: str) -> dict[str, str]:
    """The page's text under each ### heading, up to the next heading."""
    parts = re.split(r"^(#{2,3} .*)$", page, flags=re.M)
    return {heading.lstrip("# ").strip(): body for heading, body in zip(parts[1::2], parts[2::2])}


def test_the_options_reference_lists_the_training_options_by_concern():
    """The page groups them as --help-all does: every TrainConfig option in its concern's section, in order."""
    from ddp_amp.commands.panels import PANELS

    page = (DOCS / "options.md").read_text()
    sections = _sections(page)
    flags = {spec.name: spec.flag for spec in option_specs()}
    misplaced = [f"{flags[name]} not under {panel}" for panel, names in PANELS.items() for name in names
                 if f"| `{flags[name]}`" not in sections.get(panel, "")]
    assert misplaced == []
    headings = [page.index(f"\n### {panel}\n") for panel in PANELS]
    assert headings == sorted(headings)


def test_a_stale_reference_fails_the_check(monkeypatch, tmp_path):
    """The staleness check itself: an option moved to another concern changes the page, and a committed page
    that is not what the code writes makes `generate_options.py --check` exit 1."""
    generator = _generator()
    before = generator.options_reference()
    from ddp_amp.cli import app

    command = generator.typer.main.get_command(app)
    monkeypatch.setattr(generator.typer.main, "get_command", lambda _: command)
    for name in ("spawn", "run", "multinode", "bench"):
        lr = next(p for p in command.commands[name].params if p.name == "lr")
        monkeypatch.setattr(lr, "rich_help_panel", "Evaluation")
    moved = generator.options_reference()
    assert moved != before
    page = tmp_path / "options.md"
    page.write_text(before)
    monkeypatch.setattr(generator, "PAGE", page)
    monkeypatch.setattr(sys, "argv", ["generate_options.py", "--check"])
    assert generator.main() == 1
    page.write_text(moved)
    assert generator.main() == 0


def _documented_command_lines() -> list[tuple[str, list[str]]]:
    """Every `ddp-amp spawn|run|multinode|bench ...` line of the README's and docs' shell blocks, continuation
    lines joined and comments dropped: (page, words after `ddp-amp`). Lines with a shell variable, a
    placeholder or a --config file (read when parsed) are left out."""
    import shlex

    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if not re.match(r"(\.venv/bin/)?ddp-amp (spawn|run|multinode|bench)\b", line):
                    continue
                if any(mark in line for mark in ("$", "<", "...", "--config", "|", "&&")):
                    continue
                found.append((page.name, shlex.split(line)[1:]))
    return found


@pytest.mark.parametrize(("page", "words"), _documented_command_lines(),
                         ids=[f"{p}: {' '.join(w)[:60]}" for p, w in _documented_command_lines()])
def test_every_documented_command_line_parses(page, words):
    """Each documented launch's options are ones the command takes, with values it accepts: click parses and
    converts them all (a script's words after SCRIPT stay the script's), and nothing is run."""
    import typer

    from ddp_amp.cli import app

    command = typer.main.get_command(app).commands[words[0]]
    context = command.make_context(words[0], words[1:])  # raises on an unknown option or a bad value
    assert context.params
