"""``vlmbind models``: every registered model with its family, shape, image-token grid(s) and weights.

The rows come from the declarations file (:mod:`vlmbind.core.declared`), so the table prints without building a
model or importing torch; :func:`declarations` builds every model to write that file again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ...core.choices import registered_names
from .arguments import format_table, one_line

# the image size `vlmbind models` probes each model's image-token grid(s) with
PROBE_SIZE = 224
# the forms of `vlmbind models --families`
FAMILY_FORMS = ("full", "compact")

# its place in `vlmbind --help`
HELP_ORDER = 10


def add_parser(sub: Any, common: Any) -> None:
    models = sub.add_parser(
        "models", parents=[common], help="list the registered models",
        description=f"One row per registered model: family, layers x heads, the image-token grid(s) of a "
                    f"{PROBE_SIZE}x{PROBE_SIZE} image, and where the weights come from.",
    )
    models.add_argument("--families", nargs="?", const="full", choices=FAMILY_FORMS, metavar="full|compact",
                        help="instead, one row per supported family: what works on it, as a markdown table derived "
                             "from the adapters' declarations (full, the default: every cell with its reason, "
                             "docs/families.md's; compact: yes / no with numbered reasons, families with the same cells "
                             "in one row, the README's); loads no model")
    models.set_defaults(func=cmd_models)


def families_table(form: str = "full") -> tuple[list[dict[str, str]], str]:
    """The families table's rows and its markdown: ``full``, every cell as the adapters state it, with the columns'
    legend (docs/families.md); ``compact``, yes / no with numbered reasons, one row per kind of family (the README's
    "Supported families")."""
    from ...adapters.capabilities import compact_table, family_rows, legend, markdown_table
    from ...tiny import tiny_names_by_family

    rows = family_rows(tiny_names_by_family())
    if form == "compact":
        return rows, compact_table(rows)
    heading = "\nWhat a `yes` means in each column (any other cell says why not):\n\n"
    return rows, markdown_table(rows) + heading + legend()


def describe_model(name: str) -> dict[str, Any]:
    """Load one registered model and describe it, including the image-token grid(s) of a probe image.

    Returns:
        ``name, family, display_name, layers, heads, kv_heads, d_head, d_model, vision_layers, image_tokens,
        grids [{name, image, rows, cols}], key_grids (the same, over cross-attention keys), source``.
    """
    from PIL import Image

    from ...engine import loading

    vlm = loading.load(name)
    probe = Image.new("RGB", (PROBE_SIZE, PROBE_SIZE), "white")
    index = vlm.prepare(probe, "What is in this image?").index[0]
    d = vlm.describe()
    if vlm.n_layers == 0:  # a standalone vision encoder: no language model, one patch grid
        return {"name": name, "family": d["family"], "display_name": d["display_name"], "layers": 0, "heads": 0,
                "kv_heads": 0, "d_head": 0, "d_model": d["hidden"], "vision_layers": d["vision_layers"],
                "image_tokens": index.n_tokens,
                "grids": [{"name": "patches", "image": 0, "rows": index.rows, "cols": index.cols}],
                "source": vlm.source}
    return {
        "name": name,
        "family": d["family"],
        "display_name": d["display_name"],
        "layers": d["layers"],
        "heads": d["heads"],
        "kv_heads": d["kv_heads"],
        "d_head": d["d_head"],
        "d_model": d["d_model"],
        "vision_layers": d["vision_layers"],
        "image_tokens": int(len(index.image_positions)),
        "grids": [{"name": g.name, "image": g.image, "rows": g.shape[0], "cols": g.shape[1]} for g in index.grids],
        # cross-attention image keys laid on the image (Llama-3.2-Vision, whose sequence holds no image tokens)
        "key_grids": [{"name": g.name, "image": g.image, "rows": g.shape[0], "cols": g.shape[1]}
                      for g in getattr(index, "key_grids", [])],
        "source": vlm.source,
    }


def declarations() -> dict[str, Any]:
    """What the declarations file holds: every registered model described by building it (:func:`describe_model`),
    and the fingerprints of the shipped organisms' files its rows were computed from."""
    from ...core.declared import fingerprint

    names = registered_names()
    return {"written_by": "python scripts/declare_models.py", "probe_size": PROBE_SIZE,
            "fingerprints": {n: f for n in names if (f := fingerprint(n)) is not None},
            "models": [describe_model(name) for name in names]}


def write_declarations(path: Path | None = None) -> Path:
    """Build every registered model and write the declarations file (default: the one ``vlmbind models`` reads)."""
    from ...core.declared import DECLARED_FILE
    from ...core.io import write_text_atomic

    path = path or DECLARED_FILE
    write_text_atomic(json.dumps(declarations(), indent=1) + "\n", path)
    return path


def cmd_models(args: argparse.Namespace, command: list[str]) -> tuple[dict[str, Any], str, int]:
    """``vlmbind models``: one row per registered name, from the declarations file.

    A name the file does not declare (or a shipped organism whose files changed since) is described by building it.
    A registered model that fails to build is listed with its ``error`` (the other rows are still useful) and makes
    the exit code 1: a registered name that cannot load is a bug in vlmbind, not bad input.
    """
    if getattr(args, "families", None):
        from ...adapters.capabilities import CAPABILITIES

        families, table = families_table(args.families)
        return {"command": "models", "families": families, "capabilities": CAPABILITIES}, table.rstrip("\n"), 0
    from ...core.declared import declared_rows

    declared = declared_rows(PROBE_SIZE)
    rows, failed = [], []
    for name in registered_names():
        if name in declared:
            rows.append(declared[name])
            continue
        try:
            rows.append(describe_model(name))
        except Exception as exc:  # noqa: BLE001 - reported per row, and through the exit code
            failed.append({"name": name, "error": one_line(f"{type(exc).__name__}: {exc}")})
    table = format_table(
        ["name", "family", "layers x heads (kv)", f"image grid(s) @{PROBE_SIZE}px", "weights"],
        [
            [
                r["name"], r["display_name"], f"{r['layers']} x {r['heads']} ({r['kv_heads']})",
                " + ".join(f"{g['name']} {g['rows']}x{g['cols']}" for g in r["grids"] or r.get("key_grids", []))
                + (f" = {r['image_tokens']}" if r["grids"] else " cross-attention keys"),
                r["source"],
            ]
            for r in rows
        ],
    )
    for f in failed:
        table += f"\n{f['name']}  FAILED: {f['error']}"
    summary = {"command": "models", "probe_image": [PROBE_SIZE, PROBE_SIZE], "models": rows, "failed": failed}
    return summary, table, 1 if failed else 0
