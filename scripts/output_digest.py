"""Run the organism's CLI outputs (demo, locate, ablate, edit, rsa, track, probe, export) into one folder and print a
digest of every file written, so two versions of vlmbind can be compared: ``python scripts/output_digest.py OUT``.

What is normalised before hashing, and why: recorded timings (``*seconds*``, ``elapsed*``, ``wall*`` keys in JSON,
the same columns in CSV and in HTML tables), the recorded command line and output paths (they name OUT), and plotly's random div ids.
Everything else must match byte for byte.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

MODEL = "organism-p2a"
TIMING_KEY = re.compile(r"(seconds|elapsed|wall|_s$|time)", re.I)
UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def commands(out: Path) -> list[list[str]]:
    m = ["--model", MODEL]
    loc = out / "locate"
    return [
        ["demo", *m, "--out", str(out / "demo")],
        ["locate", *m, "--condition", "id_selection", "--n-pairs", "6", "--out", str(loc / "id_selection")],
        ["locate", *m, "--condition", "feature_retrieval", "--n-pairs", "6", "--out", str(loc / "feature_retrieval")],
        ["locate", *m, "--condition", "id_retrieval", "--n-pairs", "4", "--method", "attribution",
         "--out", str(loc / "id_retrieval_attr")],
        ["locate", *m, "--condition", "attention_swap", "--n-pairs", "3", "--out", str(loc / "attention_swap")],
        ["ablate", *m, "--task", "scene", "--scores", str(loc / "feature_retrieval" / "scores.csv"), "--top-k", "3",
         "--n", "24", "--out", str(out / "ablate")],
        ["edit", *m, "--scores", str(loc / "id_selection" / "scores.csv"), "--top-k", "2", "--alpha", "0,1,4",
         "--n-estimate", "256", "--n-eval", "16", "--repair", "--out", str(out / "edit")],
        ["rsa", *m, "--permutations", "50", "--out", str(out / "rsa")],
        ["track", *m, "--task", "count", "--n", "6", "--out", str(out / "track")],
        ["probe", *m, "--family", "linear,attention", "--n-train", "64", "--n-val", "16", "--n-test", "16",
         "--epochs", "3", "--out", str(out / "probe")],
        ["export", str(loc / "feature_retrieval"), "--format", "csv", "--out", str(out / "export_locate")],
        ["export", str(out / "ablate"), "--format", "html", "--out", str(out / "export_ablate")],
        ["export", str(out / "rsa"), "--format", "csv", "--out", str(out / "export_rsa")],
        ["export", str(out / "demo"), "--format", "csv", "--out", str(out / "export_demo")],
    ]


def scrub(obj, root: str):
    if isinstance(obj, dict):
        return {k: ("<t>" if TIMING_KEY.search(k) else "<cmd>" if k in ("command", "out", "argv") else scrub(v, root))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, root) for v in obj]
    if isinstance(obj, str):
        return obj.replace(root, "<OUT>")
    return obj


TABLE = re.compile(r"<table.*?</table>", re.S)
CELL = re.compile(r"<t([hd])>(.*?)</t[hd]>", re.S)


def scrub_table(html: str) -> str:
    """An HTML table with the cells of its timing columns (a header matching :data:`TIMING_KEY`) blanked."""
    headers = [text for kind, text in CELL.findall(html) if kind == "h"]
    timed = {i for i, h in enumerate(headers) if TIMING_KEY.search(h)}
    if not timed:
        return html

    def row(match: re.Match) -> str:
        cells = itertools.count()
        return CELL.sub(lambda c: "<td><t></td>" if c.group(1) == "d" and next(cells) in timed else c.group(0),
                        match.group(0))

    return re.sub(r"<tr>.*?</tr>", row, html, flags=re.S)


def digest(path: Path, root: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".json":
        try:
            data = json.dumps(scrub(json.loads(data), str(root)), sort_keys=True).encode()
        except ValueError:
            pass
    elif path.suffix in (".jsonl",):
        data = b"\n".join(json.dumps(scrub(json.loads(l), str(root)), sort_keys=True).encode()
                          for l in data.splitlines() if l.strip())
    else:
        data = UUID.sub(b"<uuid>", data.replace(str(root).encode(), b"<OUT>"))
        if path.suffix == ".html":
            data = TABLE.sub(lambda m: scrub_table(m.group(0)), data.decode()).encode()
        if path.suffix == ".csv":
            lines = data.decode().splitlines()
            header = lines[0].split(",") if lines else []
            drop = {i for i, h in enumerate(header) if TIMING_KEY.search(h)}
            data = "\n".join(",".join(c for i, c in enumerate(l.split(",")) if i not in drop) for l in lines).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    vlmbind = [sys.executable, "-m", "vlmbind"]
    for cmd in commands(out):
        target = Path(cmd[cmd.index("--out") + 1])
        if target.is_dir() and any(target.iterdir()):  # finished by an earlier, interrupted call of this script
            continue
        r = subprocess.run([*vlmbind, *cmd], capture_output=True, text=True)
        print(f"# rc={r.returncode} vlmbind {' '.join(cmd)}", file=sys.stderr)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
    files = {str(p.relative_to(out)): digest(p, out) for p in sorted(out.rglob("*")) if p.is_file()
             and ".parts" not in p.parts}
    print(json.dumps(files, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
