"""The docs run as written: the README's Python blocks execute (in a scratch folder), every ``vlmbind`` command line
in the README, docs/, circuits/ and notebooks/ parses with the real parser, a few concrete ones run, and every tool
the docs name is installed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("circuits/*/README.md")),
        ROOT / "notebooks" / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
# what the docs' placeholders stand for when a line is parsed
PLACEHOLDERS = {"M": "organism-p2a", "N": "4", "S": "0", "DIR": "/tmp/vlmbind-docs", "TASK": "scene",
                "CONDITION": "id_selection", "P": "2", "T": "scene", "H": "127.0.0.1", "W": "800",
                "RESULT_DIR": "/tmp/vlmbind-docs", "...": "blocks.0.hook_resid_post"}


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced code block of a markdown file, fences paired in order."""
    blocks, language, lines = [], None, []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(lines) + "\n"))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def python_blocks(path: Path) -> list[str]:
    return [text for language, text in fenced_blocks(path) if language == "python"]


def needs_weights(block: str) -> bool:
    """A block that loads a hub checkpoint (``owner/name``): it needs weights nobody can download here."""
    return bool(re.search(r"vb\.load\(\s*\"[\w.-]+/[\w.-]+\"", block))


def command_lines(path: Path) -> list[str]:
    """Every ``vlmbind ...`` command in the file's shell blocks (``.venv/bin/vlmbind``, ``-m vlmbind`` too)."""
    out = []
    for language, block in fenced_blocks(path):
        if language not in ("", "bash", "sh", "console"):
            continue
        for line in block.splitlines():
            line = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            m = re.search(r"(?:^|\s|/)(?:-m\s+)?vlmbind\s+(\S.*)$", line)
            if m and not line.startswith(("#", "pip", "python", "make")):
                out.append(m.group(1))
    return out


def concrete(args: str) -> list[str]:
    """A documented command line made parseable: optional parts kept (the first alternative), placeholders filled."""
    args = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(" | ")[0], args)
    tokens = []
    for token in shlex.split(args):
        token = token.split("|")[0] if "|" in token and not token.startswith("--") else token
        tokens.append(PLACEHOLDERS.get(token, token))
    return tokens


# a README line that shows its result: `expression   # 1.0` (a number, then at most a parenthesis: its n, interval)
SHOWN_RESULT = re.compile(r"^(?![\w.,\s]+=[^=])(?P<expr>[^#]+?)\s+#\s+"
                          r"(?P<value>-?\d+(?:\.(?P<decimals>\d+))?)(?:\s+\(.*\))?\s*$")


def checking_shown_results(block: str) -> tuple[str, int]:
    """``block`` with every line that shows a numeric result turned into an assertion that the expression gives
    that number to the digits shown (half a unit of the last one), and how many such lines there were."""
    lines, checked = [], 0
    for line in block.splitlines():
        m = SHOWN_RESULT.match(line)
        if m and not line.startswith((" ", "\t")):
            tolerance = 0.5 * 10.0 ** -len(m.group("decimals") or "")
            expr, value = m.group("expr").strip(), m.group("value")
            line = (f"_shown = ({expr})\nassert abs(_shown - {value}) <= {tolerance} + 1e-12, "
                    f"f\"README shows {value} for {expr!r}, it gives {{_shown}}\"")
            checked += 1
        lines.append(line)
    return "\n".join(lines) + "\n", checked


def test_shown_results_become_assertions():
    block, n = checking_shown_results("x = 0.98   # 1\nround(x, ndigits=1)   # 1.0 (n=1)\nx   # a comment\n")
    assert n == 1
    exec(compile(block, "shown", "exec"), {})
    with pytest.raises(AssertionError, match="README shows 0.5"):
        exec(compile(checking_shown_results("x = 0.98\nx   # 0.5\n")[0], "shown", "exec"), {})


def test_the_docs_hold_commands_and_python():
    assert len([line for path in DOCS if path.is_file() for line in command_lines(path)]) >= 20
    assert len(python_blocks(ROOT / "README.md")) >= 5


@pytest.mark.parametrize("path", [p for p in DOCS if p.is_file()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(path):
    from vlmbind.app.commands import build_parser
    from vlmbind.app.commands.arguments import UsageError

    parser = build_parser()
    for line in command_lines(path):
        argv = concrete(line)
        try:
            parser.parse_args(argv)
        except UsageError as exc:
            pytest.fail(f"{path.name}: 'vlmbind {line}' does not parse as {argv}: {exc}")


def test_readme_python_runs_as_written(tmp_path):
    """Every README Python block, in order, as one script in a scratch folder, where every result the README shows
    (``expression   # 1.0``) is asserted; a block that loads a hub checkpoint is only compiled (no weights can be
    downloaded here)."""
    blocks = python_blocks(ROOT / "README.md")
    runnable = [b for b in blocks if not needs_weights(b)]
    for block in blocks:
        compile(block, "README block", "exec")
    assert len(blocks) - len(runnable) <= 1, "only the multi-device example may need a hub checkpoint"
    checked = [checking_shown_results(b) for b in runnable]
    assert sum(n for _, n in checked) >= 1
    script = tmp_path / "readme.py"
    script.write_text("\n".join(b for b, _ in checked))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("argv", [
    ["stimuli", "rsa", "--positions", "2", "--seed", "0", "--out", "{tmp}/rsa"],
    ["stimuli", "scene", "--n", "4", "--seed", "0", "--out", "{tmp}/scene", "--pairs", "id_selection"],
    ["locate", "--model", "organism-p2a", "--condition", "id_selection", "--n-pairs", "16", "--out", "{tmp}/loc"],
])
def test_concrete_readme_commands_run(argv, tmp_path, capsys):
    from vlmbind.app.commands import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 0, capsys.readouterr().err


def test_the_tools_the_docs_name_are_installed():
    """notebooks/README.md runs notebooks with `jupyter execute` (nbclient): it must be in the venv."""
    text = (ROOT / "notebooks" / "README.md").read_text()
    assert ".venv/bin/jupyter execute" in text and "nbconvert" not in text
    bindir = Path(sys.executable).parent
    jupyter = shutil.which("jupyter", path=str(bindir))
    assert jupyter, f"jupyter is not installed in {bindir}"
    run = subprocess.run([jupyter, "execute", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_readme_families_table_is_the_generated_one():
    """The README's families table is `vlmbind models --families` (derived from the adapters' declarations), every
    cell says yes, n/a because ... or no: ..., and every registered family has a row."""
    from vlmbind.adapters.base import ADAPTERS
    from vlmbind.app.commands.models import families_table

    rows, table = families_table()
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- BEGIN families[^\n]*-->\n(.*?)<!-- END families -->", readme, re.S)
    assert m, "the README's families table has lost its BEGIN / END markers"
    assert m.group(1) == table, "README's families table is stale: paste `vlmbind models --families` between the markers"
    assert {r["family"] for r in rows} == {a.display_name for a in ADAPTERS.values()}
    for row in rows:
        for column, cell in row.items():
            assert cell and "\n" not in cell, (row["family"], column)
    capability_columns = list(rows[0])[4:]
    assert all(r[c].startswith(("yes", "n/a because ", "no: ")) for r in rows for c in capability_columns)


def test_a_capability_note_must_say_why():
    from vlmbind.adapters.capabilities import capability_cells
    from vlmbind.adapters.qwen import Qwen2VLAdapter

    class Unclear(Qwen2VLAdapter):
        capability_notes = {"ablation": "partly"}

    class Misnamed(Qwen2VLAdapter):
        capability_notes = {"ablations": "no: never"}

    with pytest.raises(ValueError, match="must start with"):
        capability_cells(Unclear)
    with pytest.raises(ValueError, match="not a column"):
        capability_cells(Misnamed)
    assert capability_cells(Qwen2VLAdapter)["TransformerLens"].startswith("no: ")


def test_documented_chat_templates_are_what_the_tiny_models_render():
    """docs/real_checkpoints.md shows, under a `<!-- template: NAME -->` marker, the chat prompt each tiny family
    renders; rendered again here, so a template change cannot leave the page behind."""
    from conftest import get_tiny

    text = (ROOT / "docs" / "real_checkpoints.md").read_text()
    shown = re.findall(r"<!-- template: (\S+) -->\n```\n(.*?)\n```", text, re.S)
    assert len(shown) >= 6, "the page has lost its template markers"
    prompt = "in this image there is a red square , a blue circle and a"
    for name, block in shown:
        rendered = get_tiny(name).prompt_text(prompt, 1, chat=True)
        assert block == rendered.rstrip("\n"), name
