"""Start-up of the command line where no model runs, against importing torch, in one run.

Each command runs as a whole process, as a user starts it: ``python -c "import torch"`` (what any command that runs
a model pays first), ``vlmbind --help``, ``vlmbind models`` (every registered model's row, read from the
declarations file) and an argument error (``vlmbind export /nonexistent --format jpg``, refused before anything
heavy is imported). After one warm-up of each, the commands run in turn ``--repeats`` times, so that drift hits them
alike; each is reported as its median wall time and as a ratio to importing torch.

    python benchmarks/startup.py [--repeats 7] [--json] [--save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from saved import add_save_option, heading, save  # benchmarks/saved.py

BASELINE = 'python -c "import torch"'


def commands() -> dict[str, list[str]]:
    """``label -> argv`` of the timed commands; ``vlmbind`` is the console script beside this interpreter (the module
    where it is not installed)."""
    script = Path(sys.executable).parent / "vlmbind"
    vlmbind = [str(script)] if script.exists() else [sys.executable, "-m", "vlmbind"]
    return {
        BASELINE: [sys.executable, "-c", "import torch"],
        "vlmbind --help": [*vlmbind, "--help"],
        "vlmbind models": [*vlmbind, "models"],
        "vlmbind export /nonexistent --format jpg": [*vlmbind, "export", "/nonexistent", "--format", "jpg"],
    }


def timed(argv: list[str]) -> tuple[float, int]:
    """One run of ``argv`` as a fresh process: its wall time and exit code."""
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start, proc.returncode


def run(repeats: int) -> dict:
    argvs = commands()
    for argv in argvs.values():  # warm-up: the first run reads the files from disk
        timed(argv)
    seconds: dict[str, list[float]] = {label: [] for label in argvs}
    exits: dict[str, set[int]] = {label: set() for label in argvs}
    for _ in range(repeats):
        for label, argv in argvs.items():
            wall, code = timed(argv)
            seconds[label].append(wall)
            exits[label].add(code)
    baseline = statistics.median(seconds[BASELINE])
    rows = [{"command": label, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
             "ratio_to_import_torch": statistics.median(times) / baseline, "exit_codes": sorted(exits[label])}
            for label, times in seconds.items()]
    return {"repeats": repeats, "rows": rows}


def table(result: dict) -> str:
    width = max(len(r["command"]) for r in result["rows"])
    lines = [f"{'command':{width}s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'x import torch':>15s} {'exit':>5s}"]
    for r in result["rows"]:
        lines.append(f"{r['command']:{width}s} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} "
                     f"{r['ratio_to_import_torch']:15.3f} {'/'.join(map(str, r['exit_codes'])):>5s}")
    return "\n".join(lines)


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    return (heading(record, "start-up of the command line") + "\n\n"
            f"Each command as a whole process, median wall time over {record['result']['repeats']} runs taken in "
            "turn after one warm-up; \"x import torch\" is the median over that of `python -c \"import torch\"`, "
            "which any command that runs a model pays first. `vlmbind models` reads its rows from the declarations "
            "file instead of building every model, and the export's argument error is refused before anything heavy "
            "is imported.\n\n"
            # a text block: the docs tests parse the `vlmbind ...` lines of shell blocks as commands
            "```text\n" + table(record["result"]) + "\n```")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each command (default 7)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_save_option(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result = run(args.repeats)
    print(json.dumps(result) if args.json else table(result))
    if args.save_run:
        save("startup", argv if argv is not None else sys.argv[1:], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
