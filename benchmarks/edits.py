"""Position-ID edits at several head sets: one ``edit_study`` per set against ``edit_studies`` (one estimation of the
position IDs and one unedited decode shared by every set), timed in one run.

Case: what ``vlmbind validate`` runs on ``organism-vsm`` (its ID-selection heads together, then each alone; 2,048
estimation scenes, 64 evaluated, 3 objects, the default alphas, the edit at the last prompt token and the answer
positions). The ratio is the sequential time over the shared one, from this one run; ``equal`` says every set's rows
came out the same both ways.

    python benchmarks/edits.py [--model organism-vsm] [--n-estimate 2048] [--n-eval 64] [--json] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import vlmbind as vb
from vlmbind.analysis.edits import edit_studies, edit_study
from vlmbind.analysis.validate import held_out_objects, recorded_planted
from vlmbind.core.choices import DEFAULT_ALPHAS

from saved import add_save_option, code_block, heading, save  # benchmarks/saved.py


def run(model: str, n_estimate: int, n_eval: int) -> dict:
    vlm = vb.load(model)
    selection = recorded_planted(model)["id_selection"]
    sets = [selection] + [[h] for h in selection]
    kwargs = dict(n_estimate=n_estimate, n_eval=n_eval, seed=1000, n_objects=held_out_objects(vlm),
                  entropy="high", positions="answer")
    start = time.perf_counter()
    one_by_one = [edit_study(vlm, ",".join(heads), list(DEFAULT_ALPHAS), **kwargs) for heads in sets]
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    shared = edit_studies(vlm, [",".join(heads) for heads in sets], list(DEFAULT_ALPHAS), **kwargs)
    together = time.perf_counter() - start
    return {"model": model, "head_sets": [" ".join(h) for h in sets], "n_estimate": n_estimate, "n_eval": n_eval,
            "alphas": list(DEFAULT_ALPHAS), "sequential_s": round(sequential, 2), "shared_s": round(together, 2),
            "ratio": round(sequential / together, 2),
            "equal": all(a.rows == b.rows and a.records == b.records for a, b in zip(one_by_one, shared))}


def table(out: dict) -> str:
    return (f"{out['model']}: head sets {', '.join(out['head_sets'])}; {out['n_estimate']} estimation scenes, "
            f"{out['n_eval']} evaluated, alphas {out['alphas']}\n"
            f"one edit_study per set  {out['sequential_s']:8.2f} s\n"
            f"edit_studies (shared)   {out['shared_s']:8.2f} s   x{out['ratio']:.2f}   same rows: {out['equal']}")


def render(record: dict) -> str:
    """RESULTS.md's section for a saved run."""
    return (heading(record, "position-ID edits at several head sets") + "\n\n"
            "What `vlmbind validate` runs on organism-vsm: its ID-selection heads together, then each alone, the edit "
            "at the answer positions. One `edit_study` per set estimates the position IDs and decodes the unedited "
            "answers once per set; `edit_studies` does each once for all sets.\n\n"
            + code_block(table(record["result"])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="organism-vsm")
    p.add_argument("--n-estimate", type=int, default=2048)
    p.add_argument("--n-eval", type=int, default=64)
    p.add_argument("--json", action="store_true")
    add_save_option(p)
    args = p.parse_args(argv)
    out = run(args.model, args.n_estimate, args.n_eval)
    if args.json:
        print(json.dumps(out))
    else:
        print(table(out))
    if args.save_run:
        save("edits", argv if argv is not None else sys.argv[1:], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
