"""The command line answers at once where no model is needed: ``import vlmbind``, ``vlmbind --help`` and every
subcommand's ``--help``, a misspelt registered name (close matches) and a hub id missing from the Hugging Face cache
(one line saying how to fetch it) import no torch and finish well under a second on an idle machine. The limits
below are generous (the test machine may be busy); the measured times are printed (``pytest -s``).

The choices the parsers offer live in :mod:`vlmbind.core.choices`; the heavy modules that use them import them from there,
and the registries they keep of their own must agree with them (checked here).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmbind.app.commands import build_parser
from vlmbind.app.commands.arguments import check_model
from vlmbind.core import choices
from vlmbind.core.errors import ModelLoadError, UnsupportedModelError

ROOT = Path(__file__).resolve().parents[2]
COMMANDS_DIR = ROOT / "vlmbind" / "app" / "commands"
HEAVY = ("torch", "transformers", "numpy", "pandas", "scipy", "PIL", "plotly", "safetensors", "sklearn", "dash")
HELP_LIMIT_S = 3.0
ERROR_LIMIT_S = 4.0

# runs the command in a fresh interpreter, then writes the heavy modules it imported to $VLMBIND_TEST_MODULES
_RUN = (
    "import json, os, sys\n"
    "from vlmbind.app.commands import main\n"
    "code = main(sys.argv[1:])\n"
    "heavy = " + repr(HEAVY) + "\n"
    "with open(os.environ['VLMBIND_TEST_MODULES'], 'w') as f:\n"
    "    json.dump(sorted(m for m in heavy if m in sys.modules), f)\n"
    "sys.exit(code)\n"
)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # the check must not need it
    return env | {"HF_HUB_CACHE": str(tmp_path / "hub"), "VLMBIND_TEST_MODULES": str(tmp_path / "modules.json"),
                  "PYTHONPATH": str(ROOT)}


def _run(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """``vlmbind ARGV`` in a fresh interpreter: the process, its wall time and the heavy modules it imported."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_env(tmp_path), check=False)
    seconds = time.perf_counter() - start
    imported = json.loads((tmp_path / "modules.json").read_text())
    print(f"vlmbind {' '.join(argv)}: {seconds:.2f} s, exit {proc.returncode}, heavy modules {imported}")
    return proc, seconds, imported


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert lines[0].startswith("vlmbind: error: ") and "Traceback" not in err
    return lines[0]


def test_import_vlmbind_does_not_import_torch():
    code = ("import sys, time\nt = time.perf_counter()\nimport vlmbind\nt = time.perf_counter() - t\n"
            "assert 'torch' not in sys.modules, 'import vlmbind imported torch'\n"
            "print(vlmbind.__version__, round(t, 3))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, seconds = proc.stdout.split()
    print(f"import vlmbind: {seconds} s")
    from vlmbind.version import __version__

    assert version == __version__


def test_the_public_names_load_on_use():
    """Every name of ``__all__`` resolves (lazily), ``dir`` lists them, and ``vb.evaluate`` stays the function even
    when something imported the module ``vlmbind.analysis.evaluation`` before the package's name was looked up."""
    code = (
        "import sys\n"
        "import vlmbind.analysis.evaluation\n"
        "import vlmbind as vb\n"
        "module = sys.modules['vlmbind.analysis.evaluation']\n"
        "assert vb.evaluate is module.evaluate and callable(vb.evaluate)\n"
        "from vlmbind import load, VLM, stimuli, InputError\n"
        "assert load is vb.load and VLM is vb.VLM and stimuli is sys.modules['vlmbind.stimuli']\n"
        "assert InputError is sys.modules['vlmbind.core.errors'].InputError\n"
        "missing = [n for n in vb.__all__ if getattr(vb, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(vb.__all__) <= set(dir(vb))\n"
        "assert vb.analysis.mediation.CONDITIONS  # a submodule, reachable as with the eager import\n"
        "try:\n    vb.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _subcommands() -> list[str]:
    parser = build_parser()
    return list(parser._subparsers._group_actions[0].choices)  # argparse keeps them here


@pytest.mark.parametrize("argv", [["--help"], *[[name, "--help"] for name in _subcommands()]],
                         ids=lambda argv: " ".join(argv))
def test_help_is_fast_and_imports_nothing_heavy(argv, tmp_path):
    proc, seconds, imported = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: vlmbind" in proc.stdout and proc.stderr == ""
    assert imported == [], f"vlmbind {' '.join(argv)} imported {imported}"
    assert seconds < HELP_LIMIT_S, f"vlmbind {' '.join(argv)} took {seconds:.2f} s"


def test_the_console_script_help_is_fast(tmp_path):
    script = Path(sys.executable).parent / "vlmbind"
    assert script.exists(), f"{script} is missing: make setup installs the package with its console script"
    for argv in (["--help"], ["locate", "--help"]):
        start = time.perf_counter()
        proc = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
        seconds = time.perf_counter() - start
        print(f"{script.name} {' '.join(argv)}: {seconds:.2f} s")
        assert proc.returncode == 0 and "usage: vlmbind" in proc.stdout, proc.stderr[-2000:]
        assert seconds < HELP_LIMIT_S, f"{script.name} {' '.join(argv)} took {seconds:.2f} s"


def test_models_reads_its_rows_without_importing_anything_heavy(tmp_path):
    """``vlmbind models`` prints the declared rows (the same facts as building every model: tests/app/test_cli.py)
    of every registered name, in order, as text and as JSON, without building a model."""
    from vlmbind.app.commands.models import PROBE_SIZE
    from vlmbind.core.declared import declared_rows

    names = choices.registered_names()
    proc, seconds, imported = _run(["models", "--json"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert imported == [], f"vlmbind models imported {imported}"
    summary = json.loads(proc.stdout)
    assert summary["failed"] == [] and summary["probe_image"] == [PROBE_SIZE, PROBE_SIZE]
    assert summary["models"] == [declared_rows(PROBE_SIZE)[name] for name in names]
    assert seconds < HELP_LIMIT_S, f"vlmbind models --json took {seconds:.2f} s"
    proc, seconds, imported = _run(["models"], tmp_path)
    assert proc.returncode == 0 and imported == [], imported
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["name", "family"] and [line.split()[0] for line in lines[1:]] == names
    assert seconds < HELP_LIMIT_S, f"vlmbind models took {seconds:.2f} s"


def _export_cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """``label -> (arguments, what the one error line says)`` of export arguments refused without reading a result."""
    results, exported = tmp_path / "results", tmp_path / "exported"
    results.mkdir()
    exported.mkdir()
    (exported / choices.EXPORT_MANIFEST).write_text("{}")
    (tmp_path / "file").write_text("x")
    return {
        "format": ([str(results), "--format", "jpg"], "unknown export format 'jpg'; pass one of png, svg"),
        "format first": (["/nonexistent", "--format", "jpg"], "unknown export format 'jpg'"),
        "missing": ([str(tmp_path / "missing")], "does not exist"),
        "a file": ([str(tmp_path / "file")], "is not a directory"),
        "size of html": ([str(results), "--width", "800"], "apply to png, svg and pdf, not html"),
        "scale": ([str(results), "--format", "png", "--scale", "0"], "scale must be a number in (0, 20]"),
        "an export": ([str(exported)], "is the output of vlmbind export"),
    }


@pytest.mark.parametrize("case", ["format", "format first", "missing", "a file", "size of html", "scale",
                                  "an export"])
def test_export_refuses_its_arguments_before_importing_anything_heavy(case, tmp_path):
    argv, needle = _export_cases(tmp_path)[case]
    proc, seconds, imported = _run(["export", *argv], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert needle in _one_error_line(proc.stderr)
    assert imported == [], f"vlmbind export {' '.join(argv)} imported {imported}"
    assert seconds < ERROR_LIMIT_S, f"took {seconds:.2f} s"
    assert not list(tmp_path.rglob("export")) and not (tmp_path / "runs").exists()  # nothing written


# arguments refused by the commands' own checks (no model needed), with what the one error line says
ARGUMENT_ERRORS = {
    "track --threshold": (["track", "--model", "organism-p2a", "--task", "count", "--threshold", "1.5"],
                          "--threshold must be in [0, 1), got 1.5"),
    "probe --family": (["probe", "--model", "organism-p2a", "--family", "cubic"], "--family 'cubic': unknown"),
    "probe --lr": (["probe", "--model", "organism-p2a", "--lr", "0"], "--lr must be positive"),
    "rsa --out": (["rsa", "--model", "organism-p2a", "--out", "{file}"], "is an existing file"),
    "demo --out": (["demo", "--out", "{file}"], "is an existing file"),
    # ablate: the heads, the random pools and the output folder, before the model loads
    "ablate --heads": (["ablate", "--model", "organism-p2a", "--task", "scene", "--heads", "1-2"],
                       "head '1-2' is not LAYER.HEAD"),
    "ablate --heads repeated": (["ablate", "--model", "organism-p2a", "--task", "scene", "--heads", "1.2,1.2"],
                                "--heads: heads ['1.2'] are given more than once"),
    "ablate --random-from": (["ablate", "--model", "organism-p2a", "--task", "scene", "--heads", "1.2",
                              "--random-from", "rest,nearby"], "--random-from 'rest,nearby': unknown pool 'nearby'"),
    "ablate --out": (["ablate", "--model", "organism-p2a", "--task", "scene", "--heads", "1.2", "--out", "{file}"],
                     "is an existing file"),
    # eval: the task's options, the batches against the ranks, the output folder
    "eval --entropy on count": (["eval", "--model", "organism-p2a", "--task", "count", "--entropy", "low"],
                                "--entropy does not apply to task 'count'"),
    "eval --processes": (["eval", "--model", "organism-p2a", "--task", "scene", "--n", "2", "--batch-size", "2",
                          "--processes", "2"], "makes 1 batches, fewer than --processes 2"),
    "eval --out": (["eval", "--model", "organism-p2a", "--task", "scene", "--out", "{file}"], "is an existing file"),
    # validate: the methods, modes, alphas and reference heads' conditions, the output folder
    "validate --methods": (["validate", "--model", "organism-vsm", "--methods", "exact,magic"],
                           "--methods ['magic'] are not among"),
    "validate --methods naive alone": (["validate", "--model", "organism-vsm", "--methods", "naive"],
                                       "add exact to --methods"),
    "validate --modes": (["validate", "--model", "organism-vsm", "--modes", "zero,half"],
                         "--modes ['half'] are not among"),
    "validate --alpha": (["validate", "--model", "organism-vsm", "--alpha", "1,x"], "--alpha '1,x' must be"),
    "validate --alpha inf": (["validate", "--model", "organism-vsm", "--alpha", "1,inf"], "alpha inf is not finite"),
    "validate --heads": (["validate", "--model", "organism-vsm", "--heads", "counting=1.0"],
                         "reference conditions ['counting'] are not the conditions validated here"),
    "validate --out": (["validate", "--model", "organism-vsm", "--out", "{file}"], "is an existing file"),
    # circuit: the position classes, channels, layers, heads and condition
    "circuit --from": (["circuit", "--model", "organism-vsm", "--condition", "id_selection", "--from", "names"],
                       "--from 'names' is not a position class"),
    "circuit --to box": (["circuit", "--model", "organism-vsm", "--condition", "id_selection", "--to", "box:1,2,3"],
                         "a box is box:X0,Y0,X1,Y1"),
    "circuit --channels": (["circuit", "--model", "organism-vsm", "--condition", "id_selection", "--channels", "q,o"],
                           "--channels 'q,o': list some of q, k, v"),
    "circuit --layers": (["circuit", "--model", "organism-vsm", "--condition", "id_selection", "--layers", "1-x"],
                         "--layers '1-x': give layers as 0-3 or 1,2,5"),
    "circuit attention_swap": (["circuit", "--model", "organism-vsm", "--condition", "attention_swap"],
                               "vlmbind circuit takes id_retrieval"),
    "circuit --pairs with --seed": (["circuit", "--model", "organism-vsm", "--pairs", "{file}", "--seed", "3"],
                                    "--seed does not apply with --pairs"),
    # edit: the alphas, the counts, the heads, the output folder (default or given)
    "edit --alpha": (["edit", "--model", "organism-vsm", "--heads", "2.3", "--alpha", "0,nan"],
                     "alpha 'nan' is not finite"),
    "edit --n-estimate": (["edit", "--model", "organism-vsm", "--heads", "2.3", "--n-estimate", "0"],
                          "--n-estimate must be a positive int, got 0"),
    "edit --heads": (["edit", "--model", "organism-vsm", "--heads", "2.3,2.3"], "are given more than once"),
    "edit --out": (["edit", "--model", "organism-vsm", "--heads", "2.3", "--out", "{file}/below"], "is a file"),
}


@pytest.mark.parametrize("case", sorted(ARGUMENT_ERRORS))
def test_argument_errors_are_refused_before_torch_is_imported(case, tmp_path):
    argv, needle = ARGUMENT_ERRORS[case]
    (tmp_path / "file").write_text("x")
    proc, seconds, imported = _run([a.replace("{file}", str(tmp_path / "file")) for a in argv], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert needle in _one_error_line(proc.stderr)
    assert "torch" not in imported, imported
    assert seconds < ERROR_LIMIT_S, f"took {seconds:.2f} s"
    assert not (tmp_path / "runs").exists()


def test_a_misspelt_registered_name_gets_close_matches_at_once(tmp_path):
    proc, seconds, imported = _run(["locate", "--model", "orgnism-p2a", "--condition", "id_selection"], tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "unknown model name 'orgnism-p2a'" in line and "Did you mean 'organism-p2a'" in line
    assert proc.stdout == "" and "torch" not in imported, imported
    assert seconds < ERROR_LIMIT_S, f"took {seconds:.2f} s"
    assert not (tmp_path / "runs").exists()  # nothing written


def _model_commands() -> list[list[str]]:
    """Every subcommand that takes ``--model``, with the least it needs to parse: each other required option (or
    required group's first option) given its first choice, or a head label."""
    from vlmbind.app.commands import build_parser

    parser = build_parser()
    out = []
    for name, sub in parser._subparsers._group_actions[0].choices.items():  # noqa: SLF001 - argparse keeps them here
        options = {o for a in sub._actions for o in a.option_strings}  # noqa: SLF001
        if "--model" not in options:
            continue
        argv = [name]
        needed = [a for a in sub._actions if a.required and "--model" not in a.option_strings]  # noqa: SLF001
        needed += [g._group_actions[0] for g in sub._mutually_exclusive_groups if g.required]  # noqa: SLF001
        for action in needed:
            value = str(next(iter(action.choices))) if action.choices else "1.1"
            argv += [value] if not action.option_strings else [action.option_strings[-1], value]
        out.append(argv)
    return out


@pytest.mark.parametrize("command", _model_commands(), ids=lambda c: c[0])
def test_every_model_command_refuses_an_uncached_hub_id_in_one_line(command, tmp_path):
    proc, seconds, imported = _run([*command, "--model", "nobody/not-cached-model"], tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "could not read a model config from hub id 'nobody/not-cached-model'" in line
    assert "never downloads" in line and "huggingface-cli download nobody/not-cached-model" in line
    assert "directory saved with save_pretrained" in line
    assert "Retry" not in proc.stderr and proc.stdout == ""
    assert "torch" not in imported, imported
    assert seconds < ERROR_LIMIT_S, f"took {seconds:.2f} s"
    assert not (tmp_path / "runs").exists()


def test_check_model_passes_registered_names_paths_and_cached_hub_ids(tmp_path, monkeypatch):
    import huggingface_hub.constants

    for name in choices.registered_names() + ["organism-p2a", str(tmp_path)]:
        check_model(argparse.Namespace(model=name))
    # a cached config, laid out as a download leaves it
    repo = tmp_path / "models--vlmbind-test--cached"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    check_model(argparse.Namespace(model="vlmbind-test/cached"))
    with pytest.raises(ModelLoadError, match="'vlmbind-test/absent'.*never downloads"):
        check_model(argparse.Namespace(model="vlmbind-test/absent"))
    with pytest.raises(ModelLoadError, match="hub id 'gpt-nope'"):  # a hub id without an owner, not close to a name
        check_model(argparse.Namespace(model="gpt-nope"))


@pytest.mark.parametrize("name", ["orgnism-p2a", "tiny-qwen25", "organism-nope", "tiny-lava", "tiny_clip"])
def test_the_cli_check_raises_what_load_raises(name):
    """The light check and :func:`vlmbind.load` refuse a misspelt name with the same error and message."""
    from vlmbind.engine import loading

    with pytest.raises(UnsupportedModelError) as light:
        check_model(argparse.Namespace(model=name))
    with pytest.raises(UnsupportedModelError) as full:
        loading.load(name)
    assert str(light.value) == str(full.value)
    assert "Registered names:" in str(light.value)


def test_the_choices_are_the_heavy_modules_constants():
    """One source of truth: the heavy modules use the constants of vlmbind.core.choices (the same objects), and the
    registries they keep of their own have exactly the names listed there."""
    from vlmbind import tiny
    from vlmbind.analysis import ablation, binding, evaluation, mediation, rsa, tracking, validate
    from vlmbind.app import export
    from vlmbind.core import shipped
    from vlmbind.engine import encoders, loading, patching
    from vlmbind.engine import vlm as models
    from vlmbind.stimuli import answers, colorshape, tasks

    same = {
        "PROMPT_FORMATS": models.PROMPT_FORMATS, "FRAMES": answers.FRAMES, "ABLATION_MODES": ablation.MODES,
        "ABLATION_RANDOM_POOLS": ablation.RANDOM_POOLS,
        "CONDITIONS": mediation.CONDITIONS, "METHODS": mediation.METHODS, "LOCATE_CHECKPOINT": mediation.CHECKPOINT,
        "IG_STEPS": patching.IG_STEPS, "EVAL_CHECKPOINT": evaluation.CHECKPOINT,
        "VALIDATION_METHODS": validate.VALIDATION_METHODS, "DEFAULT_ALPHAS": validate.DEFAULT_ALPHAS,
        "TRACK_QUERIES": tracking.QUERIES, "TRACK_TASKS": tracking.TASKS, "PAIR_CONDITIONS": tasks.PAIR_CONDITIONS,
        "PROBE_FAMILIES": binding.PROBE_FAMILIES, "PROBE_CHECKPOINT": binding.CHECKPOINT,
        "DEFAULT_SITE_CHOICE": binding.DEFAULT_SITE_CHOICE, "RSA_DEFAULT_SITES": rsa.DEFAULT_SITES,
        "SIMILARITIES": rsa.SIMILARITIES, "EXPORT_FORMATS": export.FORMATS, "EXPORT_MANIFEST": export.MANIFEST,
        "ENCODER_NAMES": encoders.ENCODER_NAMES, "ATTN_IMPLEMENTATIONS": loading.ATTN_IMPLEMENTATIONS,
        "ORGANISM_NAMES": shipped.ORGANISM_NAMES,
    }
    for name, value in same.items():
        assert getattr(choices, name) is value, name
    # registries of the heavy modules, keyed by the names the parsers offer
    assert choices.TINY_NAMES == tiny.TINY_NAMES
    assert choices.DTYPE_NAMES == tuple(loading.DTYPES)
    assert choices.METHODS == tuple(patching.METHOD_FUNCTIONS)
    assert choices.STIMULI_TASKS == tuple(tasks.TASKS)
    assert choices.WORLD_NAMES == tuple(colorshape.WORLDS)
    assert choices.registered_names() == loading.registered_names()
    assert set(choices.PAIR_CONDITIONS) < set(choices.CONDITIONS)
    assert validate.SCENE_CONDITIONS == choices.PAIR_CONDITIONS  # what validate --heads is checked against


def test_the_parsers_offer_the_choices():
    """The flags take their choices and defaults from vlmbind.core.choices (spot checks of each kind)."""
    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices

    def action(command: str, flag: str) -> argparse.Action:
        return next(a for a in subs[command]._actions if flag in a.option_strings or a.dest == flag)

    # built-in conditions are checked by name (a pairs file brings conditions of its own)
    assert all(c in action("locate", "--condition").help for c in choices.CONDITIONS)
    assert tuple(action("locate", "--method").choices) == choices.METHODS
    assert action("locate", "--ig-steps").default == choices.IG_STEPS
    assert tuple(action("locate", "--dtype").choices) == choices.DTYPE_NAMES
    assert tuple(action("eval", "--point-frame").choices) == tuple(choices.FRAMES)
    assert tuple(action("ablate", "--mode").choices) == choices.ABLATION_MODES
    assert tuple(action("track", "--query").choices) == choices.TRACK_QUERIES
    assert tuple(action("stimuli", "task").choices) == tuple(sorted(choices.STIMULI_TASKS))
    assert tuple(action("probe", "--world").choices) == ("auto", *choices.WORLD_NAMES)
    assert action("rsa", "--sites").default == choices.RSA_DEFAULT_SITES


def test_command_modules_import_only_light_modules_at_the_top():
    """What vlmbind/app/commands/*.py import at module level (not inside functions or ``if TYPE_CHECKING``): the
    standard library, vlmbind.core.choices / errors, vlmbind.version and the command package's own modules."""
    light = {"vlmbind.core.choices", "vlmbind.core.errors", "vlmbind.version", "vlmbind.app.commands",
             "vlmbind.app.commands.arguments"}
    package = ["vlmbind", "app", "commands"]
    bad = []
    for path in sorted(COMMANDS_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
                bad += [f"{path.name}:{node.lineno} {n}" for n in names if n not in sys.stdlib_module_names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 0:
                    if module.split(".")[0] not in sys.stdlib_module_names and module != "__future__":
                        bad.append(f"{path.name}:{node.lineno} {module}")
                    continue
                stem = ".".join(package[: len(package) - node.level + 1] + ([module] if module else []))
                # `from ...core.choices import X` imports the module named; `from ... import version`, the names
                targets = {stem} if module else {f"{stem}.{a.name}" for a in node.names}
                bad += [f"{path.name}:{node.lineno} {target}" for target in sorted(targets - light)]
    assert bad == []


def test_every_flag_has_help_text():
    """Every option of every subcommand says what it does in --help."""
    import argparse

    from vlmbind.app.commands import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, subparser in sub.choices.items():
        for action in subparser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            if not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {missing}"


def _bounded_int_options() -> list[tuple[str, str, int]]:
    """``(command, flag, lowest value)`` of every option typed ``int_at_least`` (the bound lives in the type)."""
    from vlmbind.app.commands import build_parser

    found = []
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():  # noqa: SLF001
        for action in sub._actions:  # noqa: SLF001
            low = getattr(action.type, "lowest", None)
            if low is not None:
                found.append((name, action.option_strings[-1], low))
    return found


def test_the_bounded_counts_are_typed_where_the_commands_take_them():
    flags = {(c, f) for c, f, _ in _bounded_int_options()}
    assert {("ablate", "--top-k"), ("eval", "--n"), ("locate", "--n-pairs"), ("track", "--batch-size"),
            ("probe", "--n-train"), ("rsa", "--permutations"), ("ui", "--n-pairs")} <= flags


@pytest.mark.parametrize("command, flag, low", _bounded_int_options(), ids=lambda v: str(v))
def test_a_count_below_its_bound_is_refused_by_the_parser_naming_the_flag(command, flag, low, capsys):
    from vlmbind.app.commands import main

    assert main([command, flag, str(low - 1)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert flag in line and f"{low - 1} is below {low}" in line
