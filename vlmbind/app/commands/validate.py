"""``vlmbind validate``: every method scored against the heads planted in an organism (or reference heads)."""

from __future__ import annotations

from typing import Any

from ...core.choices import ABLATION_MODES as MODES
from ...core.choices import DEFAULT_ALPHAS, EDIT_POSITIONS, IG_STEPS, PAIR_CONDITIONS, VALIDATION_METHODS
from ...core.errors import InputError
from .arguments import add_placement, add_prompt_format, check_model, int_at_least, load_model, out_dir

# its place in `vlmbind --help`
HELP_ORDER = 110
# the options of one mediation method: option -> (the method it shapes, its default)
METHOD_OPTIONS = {"naive_heads": ("naive", 6), "ig_steps": ("integrated_gradients", IG_STEPS)}
# the options of the position-ID edit, which runs at the reference's id_selection heads
EDIT_OPTIONS = ("alpha", "n_estimate", "edit_positions")


def add_parser(sub: Any, common: Any) -> None:
    p = sub.add_parser("validate", parents=[common], help="score every method against planted heads",
                       description="Run head-level mediation (exact, naive, attribution, integrated gradients), "
                                   "ablation, the position-ID edit and linear probes on fresh stimuli, and score "
                                   "them against the heads an organism's training record says were planted. "
                                   "On a model with nothing planted, --reference names heads to score against. "
                                   "Planted search heads (organism-search, or --heads search=L.H) are scored by "
                                   "attention_swap mediation, attention-centroid tracking and ablation on "
                                   "counting instead.")
    p.add_argument("--model", required=True,
                   help="registered name (e.g. organism-vsm), model directory or hub id")
    add_placement(p)
    add_prompt_format(p)
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference", help="take the reference heads from another organism's training record "
                                         "(e.g. organism-vsm, to validate organism-vsm-natural against them)")
    ref.add_argument("--heads", action="append", metavar="CONDITION=L.H,...",
                     help="reference heads of one condition, e.g. id_selection=3.1 or search=2.3 (repeatable)")
    p.add_argument("--pairs", metavar="PATH",
                   help="your own counterfactual pairs (a folder holding pairs.jsonl, or the file) instead of fresh "
                        "scene pairs; --heads names the heads of their condition; the ablation is scored on their "
                        "clean inputs, and the position-ID edit and probes (vlmbind's scenes only) are skipped")
    p.add_argument("--condition", default=None, help="with --pairs: which of the file's conditions (default: its only "
                                                     "one)")
    p.add_argument("--n-pairs", type=int_at_least(1, "16"), default=None,
                   help="pairs per condition (default 16; search heads: attention_swap pairs from counting traces)")
    p.add_argument("--seed", type=int, default=None, help="stimulus seed (default 1000, away from training's)")
    p.add_argument("--objects", type=int_at_least(2, "3"),
                   help="objects per scene (default: the count the planting held out, else 3)")
    p.add_argument("--entropy", choices=("high", "low"), default=None,
                   help="scenes of distinct features (high, the default) or shared ones (low)")
    p.add_argument("--methods", default=",".join(VALIDATION_METHODS),
                   help=f"mediation methods, comma-separated (default {','.join(VALIDATION_METHODS)})")
    p.add_argument("--naive-heads", type=int_at_least(1, "6"), default=None,
                   help=f"heads naive is checked on against exact (default {METHOD_OPTIONS['naive_heads'][1]})")
    p.add_argument("--ig-steps", type=int_at_least(1, "8"), default=None,
                   help=f"integrated-gradients path points (default {IG_STEPS})")
    p.add_argument("--modes", default=",".join(MODES), help=f"ablation modes (default {','.join(MODES)})")
    p.add_argument("--n-eval", type=int_at_least(1, "64"), default=None,
                   help="scenes the ablation and the edit are scored on (default 64)")
    p.add_argument("--ablation-seeds", type=int_at_least(1, "5"), default=5,
                   help="random-k draws from the heads outside the top-k (default 5)")
    p.add_argument("--alpha", default=None,
                   help="position-ID edit scales (default " + ",".join(str(a) for a in DEFAULT_ALPHAS) + ")")
    p.add_argument("--n-estimate", type=int_at_least(1, "2048"), default=None,
                   help="scenes the position IDs are estimated from (default 2048)")
    p.add_argument("--edit-positions", choices=EDIT_POSITIONS, default=None,
                   help="where the position-ID edit is added: the prompt's last position, or also every answer "
                        "position (default: answer; the planted ID is read at both)")
    p.add_argument("--n-probe", type=int_at_least(16, "512"), default=None,
                   help="scenes for the probes and PCA, a quarter held out (default 512)")
    p.add_argument("--n-track", type=int_at_least(1, "32"), default=None,
                   help="search heads: counting displays whose traces are tracked (default 32)")
    p.add_argument("--edge-pairs", type=int_at_least(0, "8"), default=None,
                   help="id_selection pairs on which every head-to-head edge is scored by exact path patching against "
                        "the declared planted edges (default 8; 0 skips it; only where edges are declared)")
    p.add_argument("--out", default=None, help="output directory (default runs/validate/<model>)")
    p.set_defaults(func=cmd_validate)


def _given_heads(values: list[str]) -> dict[str, list[str]]:
    from ...core.sites import parse_heads

    out: dict[str, list[str]] = {}
    for value in values:
        condition, sep, heads = value.partition("=")
        if not sep or not heads:
            raise InputError(f"--heads {value!r} must read CONDITION=L.H,..., e.g. id_selection=3.1")
        out[condition.strip()] = [f"{l}.{h}" for l, h in parse_heads(heads)]
    return out


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} {text!r} must be comma-separated numbers, e.g. 1,2,4") from None


# the options of fresh scene stimuli and their defaults (a pairs file brings its own pairs)
SCENE_OPTIONS = {"n_pairs": 16, "seed": 1000, "objects": None, "entropy": "high", "n_eval": 64,
                 "alpha": ",".join(str(a) for a in DEFAULT_ALPHAS), "n_estimate": 2048, "edit_positions": "answer",
                 "n_probe": 512}
# planted search heads: the options that shape their displays, and the scene-only ones they refuse
SEARCH_OPTIONS = {"n_pairs": 16, "seed": 1000, "n_eval": 64, "n_track": 32}
SCENE_ONLY = ("pairs", "condition", "objects", "entropy", "alpha", "n_estimate", "edit_positions", "n_probe",
              "edge_pairs")


def user_pairs(args: Any) -> Any:
    """``--pairs``, read and checked before the model loads (None without it; the scene options' defaults are then
    filled in).

    Raises:
        InputError: a scene option or no --heads with --pairs; --condition without --pairs; a pairs file that does
            not validate.
    """
    given = [name for name in SCENE_OPTIONS if getattr(args, name) is not None]
    for name, default in SCENE_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.pairs is None:
        if args.condition is not None:
            raise InputError("--condition chooses among the conditions of a --pairs file; without --pairs, validate "
                             "runs every scene condition")
        return None
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InputError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply with --pairs (they shape "
                         "vlmbind's scenes); drop them")
    if not args.heads:
        raise InputError("--pairs needs --heads CONDITION=L.H,... : the heads to score the methods against")
    from ...stimuli.pairs import load_pairs

    return load_pairs(args.pairs, args.condition)


def _flags(names: list[str]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def refuse_method_options(args: Any, methods: list[str]) -> None:
    """Refuse the options of a mediation method --methods leaves out (then fill in the defaults of the others).

    Raises:
        InputError: --naive-heads without naive, --ig-steps without integrated_gradients.
    """
    for name, (method, default) in METHOD_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif method not in methods:
            raise InputError(f"{_flags([name])} does not apply: it shapes the {method} method, which --methods "
                             f"({','.join(methods)}) leaves out; drop it, or add {method} to --methods")


def refuse_unused_reference_options(given: set[str], heads: dict[str, Any], whose: str) -> None:
    """Refuse the edit's and the probes' options where the reference ``heads`` (condition -> heads, from ``whose``)
    give them nothing to run on: the edit runs at id_selection heads, the probes at any reference head.

    Raises:
        InputError: such an option given.
    """
    unused = [] if heads.get("id_selection") else [n for n in EDIT_OPTIONS if n in given]
    if unused:
        raise InputError(f"{_flags(unused)} {'does' if len(unused) == 1 else 'do'} not apply: the position-ID edit "
                         f"runs at id_selection heads and {whose} names none; drop "
                         f"{'it' if len(unused) == 1 else 'them'}, or name the heads with --heads id_selection=L.H,...")
    if "n_probe" in given and not any(heads.values()):
        raise InputError(f"--n-probe does not apply: the probes read the reference heads and {whose} names none; "
                         f"drop it, or name heads with --heads CONDITION=L.H,... or --reference")


def recorded_search_heads(model: str) -> list[str]:
    """The planted search heads a model's training record lists (a shipped organism's name or a model directory),
    read without loading anything heavy; empty where there is no record or none planted."""
    from pathlib import Path

    from ...core.results import read_json_object
    from ...core.shipped import ORGANISM_NAMES, organism_dir

    directory = organism_dir(model) if model in ORGANISM_NAMES else Path(model)
    path = directory / "vlmbind_training.json"
    if not path.is_file():
        return []
    return list((read_json_object(path).get("planted") or {}).get("search", []))


def search_mode(args: Any) -> bool:
    """Whether the heads to score are search heads: --heads search=..., --reference of an organism with planted
    search heads, or (neither given) the model's own record.

    Raises:
        InputError: --heads mixing search heads with scene conditions.
    """
    if args.heads:
        conditions = {value.partition("=")[0].strip() for value in args.heads}
        if "search" in conditions and len(conditions) > 1:
            raise InputError("--heads search=... scores search heads alone (their own displays and methods); give "
                             "scene conditions in another run")
        return conditions == {"search"}
    return bool(recorded_search_heads(args.reference or args.model))


def cmd_validate(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    check_model(args)
    if search_mode(args):
        return cmd_validate_search(args, command)
    if args.n_track is not None:
        raise InputError("--n-track does not apply: it sizes the tracking of search heads, and this model (or its "
                         "reference) has none planted; drop it, or give --heads search=L.H,...")
    if args.edge_pairs is None:
        args.edge_pairs = 8
    given = {name for name in SCENE_OPTIONS if getattr(args, name) is not None}
    pairs = user_pairs(args)
    # the checks of the arguments alone, before the imports below, which import torch
    from ...core.checks import check_ablation_modes, check_alphas, check_reference_conditions, check_validation_methods

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_validation_methods(methods, "--methods")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    check_ablation_modes(modes, "--modes")
    alphas = _floats(args.alpha, "--alpha")
    check_alphas(alphas)
    refuse_method_options(args, methods)
    reference, source = None, None
    if args.heads:
        reference, source = _given_heads(args.heads), "--heads"
        if pairs is None:
            check_reference_conditions(reference, PAIR_CONDITIONS)
            refuse_unused_reference_options(given, reference, "--heads")
    out = out_dir(args, "validate") if pairs is None else out_dir(args, "validate", pairs.condition)
    from ...analysis.validate import planted_heads, recorded_edges, recorded_planted, validate

    reference_edges = None
    if args.reference:
        reference, source = recorded_planted(args.reference), args.reference
        reference_edges = recorded_edges(args.reference)
        refuse_unused_reference_options(given, reference, f"the training record of {args.reference}")
    vlm = load_model(args)
    if reference is None and pairs is None:
        refuse_unused_reference_options(given, planted_heads(vlm), f"the training record of {vlm.name}")
    result = validate(vlm, reference=reference, reference_source=source, n_pairs=args.n_pairs, seed=args.seed,
                      n_objects=args.objects, entropy=args.entropy, methods=methods, naive_heads=args.naive_heads,
                      ig_steps=args.ig_steps, modes=modes, n_eval=args.n_eval, ablation_seeds=args.ablation_seeds,
                      alphas=alphas, n_estimate=args.n_estimate, n_probe=args.n_probe,
                      edit_positions=args.edit_positions, progress=not args.json, pairs=pairs,
                      edge_pairs=args.edge_pairs, reference_edges=reference_edges)
    result.save(out)
    summary = {**result.summary(), "prompt_format": vlm.active_prompt_format,
               "out": str(out), "command": " ".join(command)}
    return summary, render_text(result, out), 0


def cmd_validate_search(args: Any, command: list[str]) -> tuple[dict[str, Any], str, int]:
    """``vlmbind validate`` on planted search heads (:func:`vlmbind.analysis.search_validation.validate_search`)."""
    scene = [name for name in SCENE_ONLY if getattr(args, name) is not None]
    if scene:
        raise InputError(f"{_flags(scene)} {'does' if len(scene) == 1 else 'do'} not apply to search heads (they "
                         f"shape scene pairs, the position-ID edit, probes or edges); drop "
                         f"{'it' if len(scene) == 1 else 'them'}")
    for name, default in SEARCH_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    from ...core.checks import check_ablation_modes, check_validation_methods

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_validation_methods(methods, "--methods")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    check_ablation_modes(modes, "--modes")
    refuse_method_options(args, methods)
    reference, source = None, None
    if args.heads:
        reference, source = _given_heads(args.heads), "--heads"
    elif args.reference:
        reference, source = {"search": recorded_search_heads(args.reference)}, args.reference
    out = out_dir(args, "validate")
    from ...analysis.search_validation import validate_search

    vlm = load_model(args)
    result = validate_search(vlm, reference=reference, reference_source=source, n_pairs=args.n_pairs,
                             seed=args.seed, methods=methods, naive_heads=args.naive_heads, ig_steps=args.ig_steps,
                             modes=modes, n_eval=args.n_eval, ablation_seeds=args.ablation_seeds,
                             n_track=args.n_track, progress=not args.json)
    result.save(out)
    summary = {**result.summary(), "prompt_format": vlm.active_prompt_format,
               "out": str(out), "command": " ".join(command)}
    return summary, render_text(result, out), 0


def _number(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def render_text(result: Any, out: Any) -> str:
    against = f"reference heads ({result.reference})" if result.reference else "no reference heads"
    if "pairs" in result.params:
        stimuli = f"{result.params['n_pairs']} pairs of {result.params['pairs']}"
    else:
        stimuli = (f"{result.params['n_pairs']} pairs per condition, {result.params['n_objects']} objects, seed "
                   f"{result.params['seed']}")
    if result.params.get("condition") == "search":
        stimuli = (f"{result.params['n_pairs']} attention_swap pairs from counting traces, seed "
                   f"{result.params['seed']}")
    lines = [f"{result.model}: methods against {against}, {stimuli}"]
    lines.append(f"  {'condition':<18}{'method':<22}{'heads':<10}{'ranks':<10}{'recall@k':>9}{'AUROC':>8}"
                 f"{'ratio':>8}{'seconds':>9}  top heads")
    for r in result.methods:
        lines.append(f"  {r['condition']:<18}{r['method']:<22}{' '.join(r['heads']) or '-':<10}"
                     f"{' '.join(map(str, r['planted_ranks'])) or '-':<10}{_number(r['recall_at_k'], '.2f'):>9}"
                     f"{_number(r['auroc'], '.3f'):>8}{_number(r['ratio'], '.1f'):>8}{r['seconds']:>9.1f}  "
                     f"{' '.join(r['top_heads'])}")
    for condition, check in result.naive_check.items():
        lines.append(f"  naive = exact on {condition}: max |difference| {check['max_abs_difference']:.2e} over "
                     f"heads {' '.join(check['heads'])}")
    scored = f", {result.params['ablation_scored']}s right" if result.params.get("ablation_scored") else ""
    for mode, arms in result.ablation_summary().items():
        lines.append(f"  ablation ({mode}{scored}): clean {arms['clean']:.3f}, top-k {arms['top']:.3f}, random-k "
                     f"{arms['random']:.3f} (lowest of {arms['random_seeds']} seeds {arms['random_min']:.3f}), "
                     f"bottom-k by |score| {arms['bottom']:.3f}")
    for heads in result.edit_heads():
        edit = result.edit_summary(heads)
        lines.append(f"  position-ID edit at {heads}: efficacy {edit['efficacy']:.3f} at alpha {edit['alpha']:g} "
                     f"(n={edit['n']}), control {_number(edit['control'])}"
                     + (f", random-direction control {_number(edit['random_control'])}"
                        if edit.get("random_control") is not None else ""))
    for r in result.edges:
        lines.append(f"  edges ({r['method']}, {r['n_pairs']} {r['condition']} pairs, {r['sender_at']} -> "
                     f"{r['receiver_at']}): declared {', '.join(r['declared'])} ranked "
                     f"{' '.join(map(str, r['declared_ranks']))} of {r['edges']}; recall@{r['k']} "
                     f"{_number(r['recall_at_k'], '.2f')}, AUROC {_number(r['auroc'])}, {r['seconds']:.1f} s; top "
                     f"{', '.join(r['top_edges'])}")
        f = r.get("faithfulness")
        if f:
            d = f.get("declared")
            lines.append(f"    faithfulness ({f['ablation']} ablation, n={f['n']}): CPR {f['cpr']:.3f} "
                         f"[{f['cpr_ci'][0]:.3f}, {f['cpr_ci'][1]:.3f}], CMD {f['cmd']:.3f} [{f['cmd_ci'][0]:.3f}, "
                         f"{f['cmd_ci'][1]:.3f}]"
                         + (f"; declared circuit f {d['f']:.3f} [{d['ci'][0]:.3f}, {d['ci'][1]:.3f}]" if d else "")
                         + ("" if f.get("defined", True) else "; undefined: the edges do not carry the behaviour"))
    tracked = result.tracking_summary()
    if tracked is not None:
        lines.append(f"  tracking ({result.params.get('n_points')} points): lowest RMSE at {tracked['best_head']} "
                     f"({tracked['best_rmse']:.2f} cells{', a reference head' if tracked['best_is_reference'] else ''})")
        for r in tracked["reference"]:
            lines.append(f"    {r['head']}: RMSE {r['rmse']:.2f} (rank {r['rank']}), centroid within half a cell of "
                         f"the point for {r['within_half_cell']:.2f} [{r['within_ci'][0]:.2f}, "
                         f"{r['within_ci'][1]:.2f}] of {r['n_points']} points")
    for r in result.probes:
        lines.append(f"  probe {r['head']} -> {r['target']}: {r['accuracy']:.3f} held out (chance {r['chance']:.3f}, "
                     f"n={r['n_test']})")
    for what, why in result.skipped.items():
        lines.append(f"  {what} not run: {why}")
    lines.append(f"  wrote {out}/validation.json, methods.csv, edge_methods.csv, validation.html")
    return "\n".join(lines)
