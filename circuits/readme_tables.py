"""What every circuit's ``tables.py`` shares: its README's tables live between two markers and are rendered from
the saved results only, and ``--check`` says when the README and the results disagree.

A circuit's ``tables.py`` defines ``render() -> str`` and calls :func:`main` with its README and results folder.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd

BEGIN, END = "<!-- tables from results: begin -->", "<!-- tables from results: end -->"
# a number as the findings quote it: two or more decimals (sign aside)
QUOTED = re.compile(r"[-+]?\d+\.\d{2,}")


def replaced(text: str, tables: str, readme: Path) -> str:
    """``text`` with everything between the markers replaced by ``tables``."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{tables}\n{END}{tail}"


def block(text: str) -> str:
    """The README's rendered part, between the markers."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def prose(text: str) -> str:
    """The README without its rendered part (the words a person wrote)."""
    head, rest = text.split(BEGIN, 1)
    return head + rest.split(END, 1)[1]


def quoted_numbers(text: str) -> set[str]:
    return {m.lstrip("+-") for m in QUOTED.findall(text)}


def head_table(scores: pd.DataFrame, k: int = 5, digits: int = 2) -> list[str]:
    """The top-k heads by mean score with their 95% bootstrap interval and Benjamini-Hochberg q-value."""
    top = scores.sort_values(["score", "layer", "head"], ascending=[False, True, True]).head(k)
    lines = ["| head | score (logits) | 95% interval | q | significant |", "|---|---|---|---|---|"]
    for r in top.itertuples():
        lines.append(f"| {r.layer}.{r.head} | {r.score:+.{digits}f} | [{r.ci_low:+.{digits}f}, {r.ci_high:+.{digits}f}] "
                     f"| {r.q_value:.3f} | {'yes' if r.significant else 'no'} |")
    return lines


def ablation_table(result: dict) -> list[str]:
    """Accuracy per arm with its 95% interval; random-k per seed."""
    iv = result["intervals"]
    seeds = " ".join(f"{a['accuracy']:.2f}" for a in result["arms"] if a["arm"] == "random")
    pool = "outside the top-k" if result.get("random_from") == "rest" else "from all heads"
    lines = ["| arm | accuracy | 95% interval | n |", "|---|---|---|---|"]
    for arm in ("clean", "top", "random", "bottom"):
        by = {"abs": "smallest \\|score\\|", "score": "lowest score"}[result.get("bottom_by", "score")]
        label = {"top": f"top-{result['k']}", "bottom": f"bottom-{result['k']} ({by})",
                 "random": f"random-{result['k']} ({iv['random']['seeds']} seeds {pool}; per seed {seeds})"}.get(arm, arm)
        lines.append(f"| {label} | {iv[arm]['accuracy']:.2f} | [{iv[arm]['low']:.2f}, {iv[arm]['high']:.2f}] "
                     f"| {iv[arm]['n']} |")
    return lines


def main(readme: Path, results: Path, render: Callable[[], str], script: str,
         argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=f"render {readme}'s tables from {results}")
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = p.parse_args(argv)
    text = readme.read_text()
    new = replaced(text, render(), readme)
    if args.check:
        if new != text:
            print(f"{readme} disagrees with {results}: run python {script}")
            return 1
        return 0
    readme.write_text(new)
    return 0
