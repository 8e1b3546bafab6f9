"""The documentation cannot drift from the code: docs/options.md is what the command line generates, every
training flag is in it, the README stays a front door, and every relative link leads somewhere."""

import importlib.util
import re
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
