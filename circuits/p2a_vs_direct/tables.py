"""The README's table, rendered from the saved results of ``run.py`` (never typed by hand), each accuracy with its
Wilson 95% interval over the n stimuli.

    python circuits/p2a_vs_direct/tables.py           # rewrite the README between its table markers
    python circuits/p2a_vs_direct/tables.py --check   # exit 1 when the README and the results disagree
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
import readme_tables  # noqa: E402  (circuits/readme_tables.py, shared by the circuits' tables)

from vlmbind.analysis.ablation import wilson_interval  # noqa: E402  (the intervals the ablations report)

RESULTS = HERE / "results"
README = HERE / "README.md"


def _rows() -> list:
    """run.py's rows: (label, task, options, PbP's reference cells)."""
    spec = importlib.util.spec_from_file_location("p2a_vs_direct_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROWS


def render(results: dict | None = None) -> str:
    """The table of ``results`` (default: the saved ``results/results.json``)."""
    if results is None:
        results = json.loads((RESULTS / "results.json").read_text())
    names = list(results["models"])
    n = {row["n"] for m in names for row in results["models"][m]["rows"].values()}
    lines = [f"Accuracy in % (95% Wilson interval) on n = {', '.join(map(str, sorted(n)))} fresh stimuli per row.", "",
             "| task | " + " | ".join(names) + " | PbP P2A | PbP Direct |", "|---|" + "---|" * (len(names) + 2)]
    for label, task, _, ref in _rows():
        cells = []
        for m in names:
            row = results["models"][m]["rows"][label]
            low, high = wilson_interval(row["accuracy"], row["n"])
            cell = f"{100 * row['accuracy']:.1f} [{100 * low:.1f}, {100 * high:.1f}]"
            regime = (results["models"][m].get("training") or {}).get("regime")
            if regime == "p2a" and row.get("points_exact") is not None:
                cell += f" (points {100 * row['points_exact']:.0f})"
            cells.append(cell)
        extra = ""
        if task == "query":
            ceiling = results["models"][names[0]]["rows"][label]["summary"].get("counting_ceiling")
            extra = f" (counting-only ceiling {100 * ceiling:.1f})" if ceiling is not None else ""
        lines.append(f"| {label}{extra} | " + " | ".join(cells) + f" | {ref[0] if ref else ''} | "
                     f"{ref[1] if ref else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return readme_tables.main(README, RESULTS, render, "circuits/p2a_vs_direct/tables.py", argv)


if __name__ == "__main__":
    sys.exit(main())
