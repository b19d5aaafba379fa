"""The docs run as written: the Python blocks of the README and of every docs/ page execute (each file in order as one
script, in a scratch folder, every result they show asserted), every ``vlmbind`` command line in the README, docs/,
circuits/ and notebooks/ parses with the real parser, a few concrete ones run, the generated tables are the commands'
output, and every tool the docs name is installed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# a docs line that shows its result: `expression   # 1.0` (a number, then at most a parenthesis: its n, interval)
SHOWN_RESULT = re.compile(r"^(?![\w.,\s]+=[^=])(?P<expr>[^#]+?)\s+#\s+"
                          r"(?P<value>-?\d+(?:\.(?P<decimals>\d+))?)(?:\s+\((?P<note>.*)\))?\s*$")
# a shown accuracy's uncertainty: `(n=64, 95% CI [0.94, 1.00]...)`, the Wilson interval of the shown value over n
SHOWN_INTERVAL = re.compile(r"n=(?P<n>\d+), 95% CI \[(?P<low>[\d.]+), (?P<high>[\d.]+)\]")


def checking_shown_results(block: str) -> tuple[str, int]:
    """``block`` with every line that shows a numeric result turned into an assertion that the expression gives
    that number to the digits shown (half a unit of the last one), and how many such lines there were. A shown
    ``(n=N, 95% CI [low, high])`` is asserted too: the Wilson interval of the result over N, to the digits shown."""
    lines, checked = [], 0
    for line in block.splitlines():
        m = SHOWN_RESULT.match(line)
        if m and not line.startswith((" ", "\t")):
            tolerance = 0.5 * 10.0 ** -len(m.group("decimals") or "")
            expr, value = m.group("expr").strip(), m.group("value")
            message = f"the docs show {value} for {expr}, it gives "
            line = (f"_shown = ({expr})\nassert abs(_shown - {value}) <= {tolerance} + 1e-12, "
                    f"{message!r} + repr(_shown)")
            ci = SHOWN_INTERVAL.search(m.group("note") or "")
            if ci:
                digits = max(len(ci.group(k).partition(".")[2]) for k in ("low", "high"))
                message = f"the docs show [{ci.group('low')}, {ci.group('high')}] for {expr}, its Wilson interval is "
                line += ("\nfrom vlmbind.analysis.ablation import wilson_interval as _wilson\n"
                         f"_ci = [round(x, {digits}) for x in _wilson(_shown, {ci.group('n')})]\n"
                         f"assert _ci == [{ci.group('low')}, {ci.group('high')}], {message!r} + repr(_ci)")
            checked += 1
        lines.append(line)
    return "\n".join(lines) + "\n", checked


def test_shown_results_become_assertions():
    block, n = checking_shown_results("x = 0.98   # 1\nround(x, ndigits=1)   # 1.0 (n=1)\nx   # a comment\n")
    assert n == 1
    exec(compile(block, "shown", "exec"), {})
    with pytest.raises(AssertionError, match="the docs show 0.5"):
        exec(compile(checking_shown_results("x = 0.98\nx   # 0.5\n")[0], "shown", "exec"), {})
    exec(compile(checking_shown_results('d = {"a": 0.5}\nd["a"]   # 0.5\n')[0], "quotes", "exec"), {})
    # a shown interval is the Wilson interval of the shown value over the shown n
    exec(compile(checking_shown_results("x = 1.0\nx   # 1.00 (n=64, 95% CI [0.94, 1.00])\n")[0], "ci", "exec"), {})
    with pytest.raises(AssertionError, match=r"the docs show \[0.90, 1.00\]"):
        exec(compile(checking_shown_results("x = 1.0\nx   # 1.00 (n=64, 95% CI [0.90, 1.00])\n")[0], "ci", "exec"),
             {})


# the docs pages whose Python blocks run (each page as one script); every page with a Python block must be here
PYTHON_PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if python_blocks(p))]


def test_the_docs_hold_commands_and_python():
    assert len([line for path in DOCS if path.is_file() for line in command_lines(path)]) >= 20
    assert len(python_blocks(ROOT / "README.md")) >= 4
    assert {p.name for p in PYTHON_PAGES} >= {"README.md", "python.md", "stimuli.md", "real_checkpoints.md"}


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


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_python_runs_as_written(path, tmp_path):
    """Every Python block of a page, in order, as one script in a scratch folder, where every result the page shows
    (``expression   # 1.0``, with its interval) is asserted; a block that loads a hub checkpoint is only compiled (no
    weights can be downloaded here)."""
    blocks = python_blocks(path)
    runnable = [b for b in blocks if not needs_weights(b)]
    for block in blocks:
        compile(block, f"{path.name} block", "exec")
    assert len(blocks) - len(runnable) <= 1, "only the multi-device example may need a hub checkpoint"
    checked = [checking_shown_results(b) for b in runnable]
    if path.name == "README.md":
        assert sum(n for _, n in checked) >= 1
    if not runnable:
        return
    script = tmp_path / "page.py"
    script.write_text("\n".join(b for b, _ in checked))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1800)
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


@pytest.mark.parametrize("page, form", [("README.md", "compact"), ("docs/families.md", "full")])
def test_families_tables_are_the_generated_ones(page, form, capsys):
    """The README's families table is `vlmbind models --families compact` and docs/families.md's is `vlmbind models
    --families` (both derived from the adapters' declarations), as the command prints them; every cell of the full
    one says yes, n/a because ... or no: ..., and every registered family has a row."""
    from vlmbind.adapters.base import ADAPTERS
    from vlmbind.app.commands import main
    from vlmbind.app.commands.models import families_table

    rows, table = families_table(form)
    assert main(["models", "--families", form]) == 0
    assert capsys.readouterr().out == table
    text = (ROOT / page).read_text()
    m = re.search(r"<!-- BEGIN families \(vlmbind models --families( compact)?; do not edit by hand\) -->\n"
                  r"(.*?)<!-- END families -->", text, re.S)
    assert m, f"{page}'s families table has lost its BEGIN / END markers"
    command = "vlmbind models --families" + (m.group(1) or "")
    assert command == "vlmbind models --families" + (" compact" if form == "compact" else ""), m.group(0)[:80]
    assert m.group(2) == table, f"{page}'s families table is stale: paste `{command}` between the markers"
    assert {r["family"] for r in rows} == {a.display_name for a in ADAPTERS.values()}
    assert all(re.search(rf"^\| (.*, )?{re.escape(r['family'])}(, .*)? \| ", table, re.M) for r in rows)
    for row in rows:
        for column, cell in row.items():
            assert cell and "\n" not in cell, (row["family"], column)
    capability_columns = list(rows[0])[4:]
    assert all(r[c].startswith(("yes", "n/a because ", "no: ")) for r in rows for c in capability_columns)


BENCHMARK = "circuits/ground_truth/results/benchmark"


@pytest.mark.parametrize("page, compact", [("README.md", True), ("docs/ground_truth.md", True)])
def test_benchmark_tables_are_the_saved_benchmarks(page, compact, capsys):
    """The README's and docs/ground_truth.md's benchmark tables are `vlmbind benchmark --table ... --compact` as the
    command prints it from the saved benchmark (the full one is circuits/ground_truth's); it covers every shipped
    planted organism and its twin."""
    from vlmbind.app.commands import main
    from vlmbind.core.shipped import planted_organisms

    command = f"vlmbind benchmark --table {BENCHMARK}" + (" --compact" if compact else "")
    assert main(command.split()[1:]) == 0
    table = capsys.readouterr().out
    text = (ROOT / page).read_text()
    m = re.search(r"<!-- BEGIN benchmark \((.*?); do not edit by hand\) -->\n(.*?)<!-- END benchmark -->", text,
                  re.S)
    assert m, f"{page}'s benchmark table has lost its BEGIN / END markers"
    assert m.group(1) == command
    assert m.group(2) == table, f"{page}'s benchmark table is stale: paste `{command}` between the markers"
    saved = json.loads((ROOT / BENCHMARK / "benchmark.json").read_text())
    organisms = {r["organism"] for r in saved["rows"]}
    for planted, twin in planted_organisms().items():
        assert planted in organisms and (twin is None or twin in organisms), (planted, twin)


def test_the_compact_families_table_keeps_every_reason():
    """Each family is named in exactly one compact row, whose cells are its full cells shortened: yes stays yes, a
    qualified yes is yes*, and no / n/a carry the number of their reason, which the notes under the table give word
    for word. Families share a row only when their short cells are equal (so no two rows are)."""
    from vlmbind.adapters.capabilities import CAPABILITIES, compact_table, family_rows

    rows = family_rows()
    table = compact_table(rows)
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["families", *CAPABILITIES]
    notes = dict(re.findall(r"^(\d+)\. (.*)\.$", table, re.M))
    row_of, short_rows = {}, []
    for line in lines[1:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        short_rows.append(tuple(cells[c] for c in CAPABILITIES))
        for family in cells["families"].split(", "):
            assert family not in row_of, family
            row_of[family] = cells
    assert len(set(short_rows)) == len(short_rows) < len(rows)
    assert set(row_of) == {r["family"] for r in rows}
    for row in rows:
        cells = row_of[row["family"]]
        for column in CAPABILITIES:
            full, short = row[column], cells[column]
            if full == "yes":
                assert short == "yes"
            elif full.startswith("yes"):
                assert short == "yes*"
            else:
                word, number = re.fullmatch(r"(no|n/a) \((\d+)\)", short).groups()
                reason = full.removeprefix("no: ").removeprefix("n/a because ")
                assert full.startswith(word), (row["family"], column)
                assert notes[number] == reason[0].upper() + reason[1:], (row["family"], column)


def test_the_readme_stays_short():
    """The README is a newcomer's page, at most 10 kB: details go to docs/ (a new family's row in the compact table
    is paid for there)."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 10 * 1024, f"README.md is {size} bytes; move detail into docs/ to keep it within 10,240"


def test_the_readme_names_every_family_and_every_command():
    """The README's opening names every registered family (and says how many), and its commands table is
    `vlmbind --help`'s: every subcommand once, in its order, with its help line."""
    from vlmbind.adapters.base import ADAPTERS
    from vlmbind.app.commands import COMMANDS, build_parser

    readme = (ROOT / "README.md").read_text()
    opening = " ".join(readme.split("\n## ", 1)[0].split())
    names = sorted({a.display_name for a in ADAPTERS.values()})
    missing = [n for n in names if not re.search(re.escape(n) + r"(?![\w-])", opening)]
    assert not missing, f"the README's opening does not name {missing}"
    assert f"{len(names)} families" in opening
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {c.dest: c.help for c in sub._choices_actions}
    shown = re.findall(r"^\| `vlmbind (\w+)` \| (.*) \|$", readme, re.M)
    assert [name for name, _ in shown] == list(helps) and len(helps) == len(COMMANDS)
    assert dict(shown) == helps


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
    from helpers import get_tiny

    text = (ROOT / "docs" / "real_checkpoints.md").read_text()
    shown = re.findall(r"<!-- template: (\S+) -->\n```\n(.*?)\n```", text, re.S)
    assert len(shown) >= 6, "the page has lost its template markers"
    prompt = "in this image there is a red square , a blue circle and a"
    for name, block in shown:
        if name.startswith("real-"):  # a real-vocabulary model: tests/tiny/test_real_vocab.py renders it
            continue
        rendered = get_tiny(name).prompt_text(prompt, 1, chat=True)
        assert block == rendered.rstrip("\n"), name
