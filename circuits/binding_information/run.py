"""Binding information in the organisms, in their own world: RSA of single objects, FBP's probe ladder and
IsSameObject probes, each written to ``results/<model>/`` with what was run in ``results/<model>/runs.json``.

    python circuits/binding_information/run.py                       # the three shipped organisms, in domain
    python circuits/binding_information/run.py --models organism-p2a --world fbp --sites default
    python circuits/binding_information/run.py --parts same_object   # one part only

Parts: ``rsa`` (64 single objects, compositional / conjunctive / position model matrices), ``ladder`` (linear,
quadratic, dnn and shared_factor probes on the mean of the tokens, the attention probe on the tokens, at every vision
block, the projector and every language-model layer; BalancedColorShape in the model's world unless ``--world``
says otherwise), ``pixels`` (the linear and quadratic probes on the raw pixels' mean patch, on the same images:
what needs no model at all) and ``same_object`` (pairwise IsSameObject probes on scenes whose objects cover 2 x 2
language-model tokens and repeat classes, at every site, against the class baselines). Every (site, family) cell is
checkpointed, so a killed run resumes. ``tables.py`` renders the README's tables from what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import vlmbind as vb
from vlmbind.analysis.binding import colorshape_splits, default_sites, default_world, probe_sites
from vlmbind.analysis.rsa import rsa, rsa_stimuli
from vlmbind.core.io import write_json_atomic, write_text_atomic
from vlmbind.probes import ProbeConfig, binding_information
from vlmbind.stimuli.colorshape import WORLDS, entropies

HERE = Path(__file__).parent
MODELS = ("organism-p2a", "organism-direct", "organism-vsm")
LADDER = ("linear", "quadratic", "dnn", "shared_factor", "attention")
PARTS = ("rsa", "ladder", "pixels", "same_object")


def every_site(vlm: Any) -> list[str]:
    """Every vision block, the projector and every language-model layer, in the order the image passes them."""
    return ([f"vision.blocks.{l}.hook_resid_post" for l in range(vlm.adapter.n_vision_layers)] + ["projector.hook_out"]
            + [f"blocks.{l}.hook_resid_post" for l in range(vlm.n_layers)])


def pixel_patch_means(examples: Any, patch: int) -> np.ndarray:
    """``[n, patch * patch * 3]``: each image's mean ``patch x patch`` RGB patch on the model's patch grid, the
    pooled representation a linear patch embedding would see before any learnt layer."""
    out = []
    for ex in examples:
        x = np.asarray(ex.image, dtype=np.float32) / 255.0
        h, w = (x.shape[0] // patch) * patch, (x.shape[1] // patch) * patch
        tiles = x[:h, :w].reshape(h // patch, patch, w // patch, patch, 3).transpose(0, 2, 1, 3, 4)
        out.append(tiles.reshape(-1, patch * patch * 3).mean(0))
    return np.stack(out)


def pixel_cells(examples: Any, patch: int, merge: int) -> np.ndarray:
    """``[n, cells, patch * patch * 3]``: each image cut into the model's token cells (``merge x merge`` patches of
    ``patch`` px, raster order), each cell's pixels averaged ``merge x merge`` down to one patch's size: the
    spatial tokens a model could hand on if it did nothing but merge patches."""
    out = []
    side = patch * merge
    for ex in examples:
        x = np.asarray(ex.image, dtype=np.float32) / 255.0
        rows, cols = x.shape[0] // side, x.shape[1] // side
        x = x[:rows * side, :cols * side].reshape(rows, patch, merge, cols, patch, merge, 3).mean((2, 5))
        out.append(x.transpose(0, 2, 1, 3, 4).reshape(rows * cols, patch * patch * 3))
    return np.stack(out)


def pixel_baseline(examples: Any, split: np.ndarray, world: Any, patch: int, merge: int,
                   config: ProbeConfig) -> pd.DataFrame:
    """The ladder on raw pixels, what needs no model at all: the pooled families on the mean patch
    (:func:`pixel_patch_means`) and the attention probe on the token cells (:func:`pixel_cells`)."""
    o, f = (np.array([[int(b) for b in ex.fields[key]] for ex in examples], dtype=np.float32)
            for key in ("o_code", "f_code"))
    rows = []
    mean, cells = pixel_patch_means(examples, patch), pixel_cells(examples, patch, merge)
    for family, z in (("linear", mean), ("quadratic", mean), ("attention", cells)):
        res = binding_information(z, o, f, split, entropies=entropies("test", world), family=family, config=config)
        rows.append({"site": f"pixels ({patch} px patches)", "family": family, "B_O": res.B_O,
                     "beta_O": res.beta_O, "B_star_OF": res.B_star_OF, "margin_O": res.margin_O,
                     "margin_O_se": res.margin_O_se, "CE_O": res.CE_O, "CE_O_train": res.CE_O_train,
                     "B_O_prior": res.B_O_prior, "n_test": res.n_test, "epochs": res.epochs_O,
                     "start": res.start_O})
    return pd.DataFrame(rows)


def merge_saved_ladder(probes: Any, where: Path, families: tuple[str, ...]) -> bool:
    """Refit some families only: keep the saved table's rows of the other families (same sites, same images) and
    put the new rows in their places. Returns whether saved rows were kept."""
    saved = where / "probe.json"
    if set(families) >= set(LADDER) or not saved.is_file():
        return False
    rows = json.loads(saved.read_text())["rows"]
    if not {r["site"] for r in rows} >= set(probes.frame["site"]):
        raise SystemExit(f"{saved} lacks some of the refitted sites; run every family there instead")
    new = {(r["site"], r["family"]): r for r in probes.frame.to_dict(orient="records")}
    merged = [new.pop((r["site"], r["family"]), r) if r["family"] in families else r for r in rows]
    probes.frame = pd.DataFrame(merged + list(new.values()))
    return True


def pixel_key(world: str, patch: int, merge: int, args: argparse.Namespace, config: ProbeConfig) -> dict[str, Any]:
    """Everything the no-model pixel baseline depends on: the world, the images, the token cells and the recipe."""
    return {"world": world, "patch": patch, "merge": merge, "n": [args.n_train, args.n_val, args.n_test],
            "seed": args.seed, "config": dataclasses.asdict(config)}


def same_pixel_baseline(results: Path, model: str, part: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """Another model's saved pixel baseline with the same ``key`` (the baseline never looks at the model, so it is
    the same table; an hour of attention fitting saved), or None."""
    key = json.loads(json.dumps(key))  # as saved: tuples become lists
    for runs in sorted(results.glob("*/runs.json")):
        if runs.parent.name == model:
            continue
        entry = json.loads(runs.read_text()).get(part, {})
        if "copied_from" not in entry and all(entry.get(k) == v for k, v in key.items()) \
                and (results / entry.get("file", "")).is_file():
            return entry
    return None


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    vlm = vb.load(name)
    out = Path(args.out) / name
    world = default_world(vlm) if args.world == "auto" else WORLDS[args.world]
    sites = every_site(vlm) if args.sites == "all" else default_sites(vlm)
    config = ProbeConfig(seed=args.seed)
    summary: dict[str, Any] = {"model": vlm.name, "seed": args.seed}
    if "rsa" in args.parts:
        similarity = rsa(vb.capture(vlm, rsa_stimuli(vlm, 4, args.seed), sites), permutations=1000)
        similarity.save(out / "rsa")
        summary["rsa"] = str((out / "rsa").relative_to(args.out))
    if "ladder" in args.parts:
        t0 = time.perf_counter()
        examples, split = colorshape_splits(args.n_train, args.n_val, args.n_test, args.seed, world)
        acts = vb.capture(vlm, examples, sites)
        where = out / f"ladder-{world.name}"
        families = tuple(args.families.split(","))
        probes = probe_sites(acts, split, sites=sites, families=families, config=config,
                             checkpoint=where / "probe.partial.json", world=world)
        kept = merge_saved_ladder(probes, where, families)
        probes.save(where)
        (where / "probe.partial.json").unlink(missing_ok=True)
        previous = json.loads((out / "runs.json").read_text()).get(f"ladder-{world.name}", {}) \
            if kept and (out / "runs.json").is_file() else {}
        refits = previous.get("refits", []) + ([{"families": list(families), "date": time.strftime("%Y-%m-%d"),
                                                 "config": dataclasses.asdict(config)}] if kept else [])
        summary[f"ladder-{world.name}"] = {"dir": str(where.relative_to(args.out)), "world": world.name,
                                           "n": [args.n_train, args.n_val, args.n_test],
                                           "seconds": round(time.perf_counter() - t0, 1)
                                           + (previous.get("seconds", 0.0) if kept else 0.0),
                                           **({"refits": refits} if refits else {})}
    if "pixels" in args.parts:
        t0 = time.perf_counter()
        where = out / f"ladder-{world.name}"
        vision = vlm.model.config.vision_config
        key = pixel_key(world.name, int(vision.patch_size), int(vision.spatial_merge_size), args, config)
        source = same_pixel_baseline(Path(args.out), name, f"pixels-{world.name}", key)
        if source is None:
            examples, split = colorshape_splits(args.n_train, args.n_val, args.n_test, args.seed, world)
            pixels = pixel_baseline(examples, split, world, key["patch"], key["merge"], config)
            write_text_atomic(pixels.to_csv(index=False), where / "pixels.csv")
            made = {"seconds": round(time.perf_counter() - t0, 1)}
        else:
            write_text_atomic((Path(args.out) / source["file"]).read_text(), where / "pixels.csv")
            made = {"seconds": source["seconds"], "copied_from": source["file"]}
        summary[f"pixels-{world.name}"] = {"file": str((where / "pixels.csv").relative_to(args.out)), **key, **made}
    if "same_object" in args.parts:
        from vlmbind.analysis.same_object import same_object_probes

        t0 = time.perf_counter()
        where = out / "same_object"
        result = same_object_probes(vlm, sites, n_train=args.same_train, n_val=args.same_val, n_test=args.same_test,
                                    seed=args.seed, config=config, checkpoint=where / "same_object.partial.json")
        result.save(where)
        (where / "same_object.partial.json").unlink(missing_ok=True)
        summary["same_object"] = {"dir": str(where.relative_to(args.out)),
                                  "n": [args.same_train, args.same_val, args.same_test],
                                  "seconds": round(time.perf_counter() - t0, 1)}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    p.add_argument("--world", choices=("auto", *WORLDS), default="auto",
                   help="BalancedColorShape world of the ladder (auto: the model's own)")
    p.add_argument("--sites", choices=("all", "default"), default="all",
                   help="all: every vision block, the projector and every LM layer; default: vlmbind probe's three")
    p.add_argument("--families", default=",".join(LADDER))
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-val", type=int, default=512)
    p.add_argument("--n-test", type=int, default=512)
    p.add_argument("--same-train", type=int, default=256)
    p.add_argument("--same-val", type=int, default=64)
    p.add_argument("--same-test", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; parts: {', '.join(PARTS)}")
    for name in args.models.split(","):
        done = run_model(name, args)
        runs = Path(args.out) / name / "runs.json"  # one file per model: parallel runs of other models never clash
        saved = json.loads(runs.read_text()) if runs.is_file() else {}
        write_json_atomic({**saved, **done}, runs)
        print(json.dumps(done, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
