"""The PbP table for the organisms: Point-to-Answer vs Direct-Answer accuracy, side by side with PbP's numbers.

    python circuits/p2a_vs_direct/run.py [--models organism-p2a organism-direct] [--n 200] [--seed 1] [--out DIR]

Every row is a fresh stimulus set (seed 1 by default; training draws from other streams) on the canvas each model was
trained on, scored by ``vb.evaluate``. On a real checkpoint fine-tuned with ``vlmbind.organisms.finetune_lora``, pass
its directory in ``--models``; rows then use the model's recorded training canvas if it has one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import vlmbind as vb
from vlmbind.analysis.evaluation import evaluate, training_defaults
from vlmbind.core.io import write_json_atomic, write_text_atomic

S = vb.stimuli
HERE = Path(__file__).parent


def _tables():
    """This circuit's tables.py (the README's table, rendered from results), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("p2a_vs_direct_tables", HERE / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# (row label, task, generator kwargs, PbP Qwen2.5-VL-7B reference: (P2A, Direct) or None)
ROWS = [
    ("scene, high entropy (2-4 objects)", "scene", {"entropy": "high"}, None),
    ("scene, low entropy (2-4 objects)", "scene", {"entropy": "low"}, None),
    ("binding query (3-4 objects)", "query", {}, None),
    ("search, disjunctive, 1-12 objects (ID)", "search", {"kind": "disjunctive", "n_objects": (1, 12)}, None),
    ("search, conjunctive, 1-12 objects (ID)", "search", {"kind": "conjunctive", "n_objects": (1, 12)}, None),
    ("search, disjunctive, 24 objects (OOD)", "search", {"kind": "disjunctive", "n_objects": 24}, None),
    ("search, conjunctive, 36 objects (OOD, grid capacity)", "search", {"kind": "conjunctive", "n_objects": 36},
     ("94.0 (50 targets)", "2.0-5.0 (50 targets)")),
    ("counting, 5-10 objects (ID)", "count", {"objects": (5, 10), "diversity": "high"}, None),
    ("counting, 11-15 objects (OOD)", "count", {"objects": (11, 15), "diversity": "high"}, ("78.5", "0.0")),
]
GENERATORS = {"scene": S.scene_description, "query": S.binding_query, "search": S.visual_search, "count": S.counting}


def points_exact(records: list[dict]) -> float:
    """Share of answers whose points are exactly the expected points (a P2A answer can be right with wrong points:
    this says whether the model really pointed)."""
    def grid_points(text: str) -> list[tuple[int, int]]:
        return [(round(x), round(y)) for x, y in S.parse_points(text)]

    return sum(grid_points(r["output"]) == grid_points(r["expected"]) for r in records) / max(1, len(records))


def run(models: list[str], n: int, seed: int) -> dict:
    results: dict = {"n": n, "seed": seed, "models": {}, "rows": [r[0] for r in ROWS]}
    for name in models:
        vlm = vb.load(name)
        per_row = {}
        for label, task, kwargs, _ in ROWS:
            kwargs = training_defaults(vlm, task, kwargs)
            start = time.perf_counter()
            dataset = GENERATORS[task](n, seed, **kwargs)
            result = evaluate(vlm, dataset, batch_size=32)
            points = points_exact(result.records) if task in ("search", "count") else None
            per_row[label] = {"accuracy": result.accuracy, "points_exact": points, "n": result.n,
                              "seconds": time.perf_counter() - start, "summary": dataset.summary}
            print(f"{name:18s} {label:55s} {100 * result.accuracy:6.1f}%", flush=True)
        results["models"][name] = {"source": vlm.source, "training": vlm.training, "rows": per_row}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["organism-p2a", "organism-direct"])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    results = run(args.models, args.n, args.seed)
    write_json_atomic(results, args.out / "results.json")
    table = _tables().render(results)  # the README's table (with intervals), from these results
    write_text_atomic(table + "\n", args.out / "table.md")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
