"""README.md and docs/: the short option table, the links, the generated docs/OPTIONS.md and the README's cheap
commands (marked ``<!-- readme-test: PHRASE -->`` before their code block) all match the code.

Runs in well under a minute: only the marked commands run (the what-if CLI, a config print), never the main
training job or the test suite.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lightning_pipedap.docs_options import missing_entries, render_options, stale_entries
from lightning_pipedap.strategy.config import PipeDAPConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: the two commands CI (.ci/run) and users copy: they must stay exactly as they are
MAIN_JOB = ("pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && pip install -e . "
            "&& pipedap-train")
TEST_COMMAND = ('pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu && '
                'pip install -e ".[dev]" && python -m pytest -q tests')
#: the pages the README points to for everything it leaves out
PAGES = ("OPTIONS", "EQUIVALENCE", "FAILURES", "COMPRESSION", "MEASUREMENTS", "LAUNCHING", "HOW_IT_WORKS",
         "PLANNERS")


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _short_table() -> list[tuple[str, str]]:
    """``(option, default cell)`` of every row of the README's option table."""
    text = _readme()
    section = text[text.index("## The options most users touch"):]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(\w+)` \| `?([^|`]*)`? \|", section, flags=re.M)
    assert rows, "no option rows found in the README's option table"
    return rows


def _marked_commands() -> list[tuple[str, str, list[str]]]:
    """``(command, phrase, output lines)`` of each code block marked ``<!-- readme-test: PHRASE -->``; the output
    lines are those of a plain code block that directly follows the command's block (an excerpt of its output)."""
    lines = _readme().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.fullmatch(r"<!-- readme-test(?::\s*(.*?))?\s*-->", line.strip())
        if not m:
            continue
        assert lines[i + 1].startswith("```"), f"README line {i + 2}: a marked command must be a code block"
        end = lines.index("```", i + 2)
        command = "\n".join(lines[i + 2:end]).strip()
        excerpt: list[str] = []
        j = end + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j < len(lines) and lines[j] == "```":
            excerpt = [ln for ln in lines[j + 1:lines.index("```", j + 1)] if ln.strip()]
        out.append((command, m.group(1) or "", excerpt))
    return out


def test_quick_start_commands_are_unchanged():
    text = _readme()
    assert MAIN_JOB in text, "the main job's command changed (users and docs copy it)"
    assert TEST_COMMAND in text, "the test command changed (.ci/run and CI run it)"


def test_readme_is_a_first_screen():
    text = _readme()
    assert len(text.splitlines()) <= 130 and len(text.split()) <= 1300, (
        f"README.md has {len(text.splitlines())} lines and {len(text.split())} words: move details to docs/")


@pytest.mark.parametrize("name,cell", _short_table())
def test_short_table_option_exists_with_its_default(name, cell):
    assert name in PipeDAPConfig.option_names(), f"README's table lists {name!r}, not an option of PipeDAPConfig"
    default = PipeDAPConfig.defaults()[name]
    stated = ast.literal_eval(cell.strip())
    assert stated == default and type(stated) in (type(default), int), (
        f"README's table states {name}={cell.strip()}, the default is {default!r}")


def test_doc_links_exist():
    named = set(re.findall(r"\bdocs/([\w-]+\.md)", _readme()))
    assert {f"{p}.md" for p in PAGES} <= named, "the README must point to every docs page"
    for page in sorted(DOCS.glob("*.md")):
        named |= set(re.findall(r"\bdocs/([\w-]+\.md)", page.read_text(encoding="utf-8")))
    missing = sorted(n for n in named if not (DOCS / n).is_file())
    assert not missing, f"docs pages named but missing: {missing}"


def test_docs_pages_say_what_they_cover():
    for name in PAGES:
        lines = [ln for ln in (DOCS / f"{name}.md").read_text(encoding="utf-8").splitlines() if ln.strip()]
        assert lines[0].startswith("# "), f"docs/{name}.md must start with a title"
        assert lines[1].startswith("This page "), f"docs/{name}.md: the first sentence must say what it covers"


def test_every_config_field_has_a_docstring_entry():
    assert missing_entries() == [], ("options declared without a docstring under their field in PipeDAPConfig's groups "
                                     f"(docs/OPTIONS.md is generated from them): {missing_entries()}")
    assert stale_entries() == [], f"attribute docstrings in PipeDAPConfig's groups under no option: {stale_entries()}"


def test_options_page_is_what_the_generator_renders():
    assert (DOCS / "OPTIONS.md").read_text(encoding="utf-8") == render_options(), (
        "docs/OPTIONS.md is stale: run `python -m lightning_pipedap.docs_options > docs/OPTIONS.md`")


@pytest.mark.parametrize("command,phrase,excerpt", _marked_commands(), ids=lambda v: str(v)[:40])
def test_marked_readme_command_runs(command, phrase, excerpt, tmp_path):
    exe = command.split()[0]
    if shutil.which(exe) is None:
        pytest.skip(f"{exe} is not on PATH (pip install -e . installs it)")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert phrase in proc.stdout, f"{command!r}: {phrase!r} not in its output:\n{proc.stdout[-2000:]}"
    printed = {ln.rstrip() for ln in proc.stdout.splitlines()}
    stale = [ln for ln in excerpt if ln.rstrip() not in printed]
    assert not stale, f"README's output excerpt of {command!r} differs from what it prints now: {stale}"
