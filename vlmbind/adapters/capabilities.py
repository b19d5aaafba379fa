"""What works on each family, derived from the adapters' declarations: the families tables of ``vlmbind models
--families`` (the full one, docs/families.md's) and ``vlmbind models --families compact`` (the README's).

Every cell is ``yes`` (possibly qualified, ``yes (...)``), ``n/a because ...`` or ``no: ...``; a family states a
difference in :attr:`~vlmbind.adapters.base.ModelAdapter.capability_notes`, and the rest follows from what it
declares (a TransformerLens bridge, a vision-row map, point frames), so the tables cannot drift from the code. The
compact table shortens each cell to ``yes``, ``yes*`` (a qualified yes) or ``no (N)`` / ``n/a (N)``, N numbering the
reason printed under it, and gives families with the same short cells one row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import ADAPTERS, ModelAdapter

# column -> what "yes" means there
CAPABILITIES: dict[str, str] = {
    "capture": "every LM site (hook_z, hook_pattern, residual, attention / MLP outputs), vision blocks, projector",
    "head patching": "PatchHeads / PatchHeadEntries at any positions, identity exact",
    "ablation": "zero, mean, role_mean and image_attention ablation of chosen heads",
    "exact locate": "head-level CMA by the exact prefix-cache method, equal to one forward per head",
    "circuits": "edges between heads by path patching (`vlmbind circuit`), receivers reading through q, k and v",
    "position-ID edits": "VSM's additive edit of estimated position-ID vectors",
    "object tokens": "language-model sites pooled over the image tokens each object covers (RSA, probes, "
                     "IsSameObject)",
    "vision-token sites": "vision-block rows pooled per image token or object (RSA, IsSameObject)",
    "points": "answers with points read onto the stimulus canvas (track, search heads)",
    "TransformerLens": "the TransformerLens bridge wraps the model, hooks agree",
}
PREFIXES = ("yes", "n/a because ", "no: ")


def capability_cells(adapter: type[ModelAdapter]) -> dict[str, str]:
    """Column -> cell for one family.

    Raises:
        ValueError: a note names no column or does not start with ``yes``, ``n/a because`` or ``no:``.
    """
    cells = {name: "yes" for name in CAPABILITIES}
    if not adapter.image_tokens_in_sequence:
        cells["object tokens"] = ("n/a because the image never enters the language model's sequence (only "
                                  "cross-attention keys); per-object captures of its sites are refused by name")
    if adapter.vision_row_tokens is ModelAdapter.vision_row_tokens:
        cells["vision-token sites"] = "no: the family declares no map from vision-block rows to image tokens"
    if adapter.point_frames:
        cells["points"] = "yes (" + ", ".join(f"{fmt} in {frame} pixels" if frame == "resized" else f"{fmt}: {frame}"
                                             for fmt, frame in adapter.point_frames.items()) + ")"
    else:
        cells["points"] = "yes (formats that carry their frame)"
    cells["TransformerLens"] = ("yes" if adapter.transformer_lens_bridge
                                else "no: TransformerLens has no bridge for this architecture")
    for name, note in adapter.capability_notes.items():
        if name not in CAPABILITIES:
            raise ValueError(f"{adapter.__name__}.capability_notes names {name!r}, not a column of "
                             f"{', '.join(CAPABILITIES)}")
        cells[name] = note
    for name, cell in cells.items():
        if not cell.startswith(PREFIXES):
            raise ValueError(f"{adapter.__name__}: the {name!r} cell {cell!r} must start with one of {PREFIXES}")
    return cells


def family_rows(tiny_names: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, str]]:
    """One row per registered family: family, HF class, image tokens, tiny model(s), then a cell per capability.
    ``tiny_names``: family -> its tiny models, in listing order (the tiny registry); rows follow that order, and
    families without a tiny model come last."""
    tiny_names = dict(tiny_names or {})
    order = list(tiny_names)
    rows = []
    for adapter in sorted(ADAPTERS.values(), key=lambda a: order.index(a.family) if a.family in order else len(order)):
        tiny = ", ".join(f"`{n}`" for n in (tiny_names or {}).get(adapter.family, ())) or "no: none yet"
        rows.append({"family": adapter.display_name, "HF class": f"`{adapter.model_class_name}`",
                     "image tokens": adapter.image_layout or "no: undeclared", "tiny model": tiny,
                     **capability_cells(adapter)})
    return rows


def legend() -> str:
    """What each capability column means, one markdown bullet per column."""
    return "".join(f"- **{name}**: {meaning}.\n" for name, meaning in CAPABILITIES.items())


def markdown_table(rows: Sequence[Mapping[str, str]]) -> str:
    """The rows as a GitHub markdown table (``|`` in a cell escaped)."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def compact_table(rows: Sequence[Mapping[str, str]]) -> str:
    """The rows as the README's short markdown table: per capability ``yes``, ``yes*`` (a qualified yes; the full
    table says how), or ``no (N)`` / ``n/a (N)``, with reason N listed under the table (numbered in order of first
    appearance, row by row). Families whose short cells are the same share one row, named in listing order, so the
    table grows with the kinds of family, not their number (each family's own row, and its tiny model, are the
    full table's)."""
    reasons: dict[str, int] = {}

    def short(cell: str) -> str:
        if cell == "yes":
            return "yes"
        if cell.startswith("yes"):
            return "yes*"
        word, reason = ("no", cell[len("no: "):]) if cell.startswith("no: ") else ("n/a", cell[len("n/a because "):])
        return f"{word} ({reasons.setdefault(reason, len(reasons) + 1)})"

    capabilities = [c for c in CAPABILITIES if c in rows[0]]
    groups: dict[tuple[str, ...], list[str]] = {}
    for row in rows:
        groups.setdefault(tuple(short(row[c]) for c in capabilities), []).append(row["family"])
    short_rows = [{"families": ", ".join(names), **dict(zip(capabilities, cells))} for cells, names in groups.items()]
    notes = "".join(f"{n}. {reason[0].upper()}{reason[1:]}.\n" for reason, n in reasons.items())
    return (markdown_table(short_rows) + "\n`yes*`: yes, with a qualification the full table states. Why not, for "
            "`no (N)` and `n/a (N)`:\n\n" + notes)
