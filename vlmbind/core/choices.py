"""The choices of the command line, in one light module: every constant an argument parser of
:mod:`vlmbind.app.commands` needs (choices, defaults, checkpoint file names), the registered model names, and the checks
of a model name and of export's arguments that need no model and no result.

It imports only the standard library and base modules, so ``vlmbind --help``, a misspelt model name and a refused
export answer without importing torch. The analysis, stimuli and engine modules that use these constants import them
from here (one source of truth); where a heavy module keeps a registry of its own (a dict of builders or of dtypes),
its keys are checked against the tuple here by ``tests/app/test_cli_startup.py``.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from .errors import InputError, UnsupportedModelError, close_matches
from .shipped import ORGANISM_NAMES, shipped_organisms

TINY_REGISTRATION = re.compile(r'^@register_tiny\("([^"]+)", rank=(\d+)\)$', re.M)


def tiny_names_from_builders(folder: Path = Path(__file__).parents[1] / "tiny") -> tuple[str, ...]:
    """The tiny models' names in listing order, read from the ``@register_tiny("tiny-<family>", rank=N)`` lines of
    the builder modules without importing them (that would import torch); ``tests/app/test_cli_startup.py`` checks them
    against :data:`vlmbind.tiny.TINY_NAMES`, the registry itself."""
    found = [(int(rank), name) for path in sorted(folder.glob("*.py"))
             for name, rank in TINY_REGISTRATION.findall(path.read_text(encoding="utf-8"))]
    return tuple(name for _, name in sorted(found))


# --- models (vlmbind.engine.loading, vlmbind.engine.vlm) --------------------------------------------------------------
# the random-weight tiny models, in the order `vlmbind models` lists them: read from their builders' registrations
TINY_NAMES = tiny_names_from_builders()
# the tiny standalone vision encoders (vlmbind.engine.encoders)
ENCODER_NAMES = ("tiny-clip", "tiny-siglip", "tiny-dinov2")
# --dtype (the keys of vlmbind.engine.loading.DTYPES) and --attn-implementation
DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
# --prompt-format
PROMPT_FORMATS = ("raw", "chat")

# --- locate (vlmbind.analysis.mediation, vlmbind.engine.patching) -----------------------------------------------------
# the mediation methods (the keys of vlmbind.engine.patching.METHOD_FUNCTIONS)
METHODS = ("naive", "exact", "attribution", "integrated_gradients", "atp_star")
CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval", "attention_swap")
# the conditions whose counterfactual the ui patches at the last token (vlmbind.app.ui)
UI_CONDITIONS = ("id_selection", "feature_retrieval")
LOCATE_CHECKPOINT = "locate.partial.safetensors"
IG_STEPS = 8

# --- circuit (vlmbind.analysis.circuits, vlmbind.engine.paths) ------------------------------------------------------
# the path-patching methods (the keys of vlmbind.analysis.circuits.CIRCUIT_METHODS) and the receiver channels
CIRCUIT_METHODS = ("exact", "naive", "eap", "eap_ig", "atp_star")
PATH_CHANNELS = ("q", "k", "v")
# a circuit's faithfulness: the edges outside it take the counterfactual sender values (patch) or their mean over the
# pairs (mean); the fractions of the scored edges its curve keeps (MIB's)
CIRCUIT_ABLATIONS = ("patch", "mean")
FAITHFULNESS_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
CIRCUIT_CHECKPOINT = "circuit.partial.safetensors"

# --- eval (vlmbind.analysis.evaluation) -------------------------------------------------------------------------------
# 
EVAL_CHECKPOINT = "eval.partial.jsonl"

# --- ablate, validate (vlmbind.analysis.ablation, vlmbind.analysis.validate) ------------------------------------------
ABLATION_MODES = ("image_attention", "zero", "mean", "role_mean")
# conditions whose heads act at text positions (object names, the last token): removing their attention to the
# image cannot remove them, so ablate's default mode for their scores is zero
TEXT_POSITION_CONDITIONS = ("id_retrieval", "id_selection")
# where random-k draws its heads: every head, the heads outside the top-k, or other heads of the top-k's layers
ABLATION_RANDOM_POOLS = ("all", "rest", "same_layers")
VALIDATION_METHODS = ("exact", "naive", "attribution", "integrated_gradients", "atp_star")
DEFAULT_ALPHAS = (0.5, 1.0, 2.0, 4.0, 8.0)
# where a position-ID edit is added: the prompt's last position (VSM's), or also every answer position
EDIT_POSITIONS = ("last", "answer")
# the tasks whose answers name (scene) or point at (search, count) the object attention is steered to
STEER_TASKS = ("scene", "search", "count")

# --- points (vlmbind.stimuli.answers): --point-frame, the frames of generated points ----------------------------------
FRAMES = {
    "canvas": "stimulus canvas cells: x = column, y = row, 0-based, cell centres at integers",
    "pixels": "pixels of the original image",
    "resized": "pixels of the image as the processor resized it (Qwen2.5-VL's absolute coordinates)",
    "permille": "0-1000 of the image's width and height (Qwen2-VL boxes, Molmo2 points)",
    "percent": "0-100 of the image's width and height (Molmo points)",
}

# --- track (vlmbind.analysis.tracking) --------------------------------------------------------------------------------
TRACK_QUERIES = ("emit", "self")
TRACK_TASKS = ("count", "search")

# --- lens (vlmbind.analysis.lens) -------------------------------------------------------------------------------------
# tasks whose examples carry objects with a colour and a shape (the lens reads both words at their image tokens)
LENS_TASKS = ("scene", "query")

# --- relevancy (vlmbind.analysis.relevancy) ---------------------------------------------------------------------------
RELEVANCY_METHODS = ("gradient_attention", "rollout", "input_x_gradient")
# tasks whose examples name the object asked about (fields["target"]) and have one answer
RELEVANCY_TASKS = ("query", "scene")
# the scored token: the example's expected answer's first token, or the model's own greedy first token
RELEVANCY_TARGETS = ("answer", "greedy")
# the knockout's blocked queries: every non-image position, the last prompt position, or every position
RELEVANCY_KNOCKOUT_QUERIES = ("text", "last", "all")

# --- stimuli (vlmbind.stimuli.tasks, vlmbind.stimuli.colorshape) ------------------------------------------------------
# the data sets `vlmbind stimuli` writes (the keys of vlmbind.stimuli.tasks.TASKS)
STIMULI_TASKS = ("scene", "query", "search", "count", "rsa", "colorshape")
PAIR_CONDITIONS = ("id_retrieval", "id_selection", "feature_retrieval")
# the BalancedColorShape worlds (the keys of vlmbind.stimuli.colorshape.WORLDS)
WORLD_NAMES = ("fbp", "organism")

# --- probe (vlmbind.analysis.binding) ---------------------------------------------------------------------------------
PROBE_FAMILIES = ("linear", "quadratic", "dnn", "shared_factor", "attention", "pairwise")
PROBE_CHECKPOINT = "probe.partial.json"
DEFAULT_SITE_CHOICE = ("last vision block", "projector", "middle LM layer")

# --- rsa (vlmbind.analysis.rsa) ---------------------------------------------------------------------------------------
RSA_DEFAULT_SITES = "vision.blocks.*.hook_resid_post,projector.hook_out,blocks.*.hook_resid_post"
SIMILARITIES = ("pearson", "cosine")

# --- export (vlmbind.app.export) --------------------------------------------------------------------------------------
# 
EXPORT_FORMATS = ("png", "svg", "pdf", "html", "csv")
# written into every export's output folder; export never reads a folder holding it as results
EXPORT_MANIFEST = ".vlmbind-export.json"


def check_result_dir(root: Path) -> None:
    """Refuse a result directory that is not a directory.

    Raises:
        InputError: ``root`` is missing or not a directory.
    """
    if not root.is_dir():
        raise InputError(f"{str(root)!r} is not a directory; pass a folder written by vlmbind (locate, ablate, "
                         f"edit, rsa, track, probe or demo)")


def check_export_arguments(result_dir: str | os.PathLike, fmt: str, *, width: int | None = None,
                           height: int | None = None, scale: float | None = None) -> Path:
    """Refuse what :func:`vlmbind.app.export.export_results` refuses by its arguments alone (no result read), here
    so that ``vlmbind export`` refuses them before it imports the renderers.

    Returns:
        ``result_dir`` as a :class:`~pathlib.Path`.

    Raises:
        InputError: an unknown format, a result directory that is missing, not a directory or the output of an
            export, or a page size that is not one or does not apply to the format.
    """
    if fmt not in EXPORT_FORMATS:
        raise InputError(f"unknown export format {fmt!r}; pass one of {', '.join(EXPORT_FORMATS)}")
    root = Path(result_dir)
    if not root.exists():
        raise InputError(f"result directory {str(root)!r} does not exist; pass a folder written by vlmbind")
    for label, value in (("width", width), ("height", height)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 10):
            raise InputError(f"{label} must be a whole number of pixels >= 10, got {value!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 20):
        raise InputError(f"scale must be a number in (0, 20], got {scale!r} (2 doubles the pixels of a png)")
    if fmt in ("html", "csv") and (width, height, scale) != (None, None, None):
        raise InputError(f"width, height and scale apply to png, svg and pdf, not {fmt}; drop them or pick an image "
                         f"format")
    check_result_dir(root)
    if (root / EXPORT_MANIFEST).is_file():
        raise InputError(f"{str(root)!r} is the output of vlmbind export, not a result folder; pass the folder "
                         f"that was exported")
    return root


def registered_names() -> list[str]:
    """Names :func:`vlmbind.load` accepts besides directories and hub ids (the shipped organisms of this
    installation, the tiny models, the tiny encoders)."""
    return [*shipped_organisms(), *TINY_NAMES, *ENCODER_NAMES]


def is_registered(name: str) -> bool:
    """A name :func:`vlmbind.load` builds or finds itself (an organism not shipped here included: its own error)."""
    return name in ORGANISM_NAMES or name in TINY_NAMES or name in ENCODER_NAMES


def unknown_name_error(name: str, registered: list[str]) -> UnsupportedModelError | None:
    """The error :func:`vlmbind.load` raises for ``name`` (not itself registered) when it reads as a misspelt
    registered name: ``tiny-...``, ``organism-...``, or close to one (difflib ratio 0.8) with no ``/`` and no such
    path. None when ``name`` may be a directory or hub id."""
    near = difflib.get_close_matches(name, registered, n=3, cutoff=0.8)
    if name.startswith(("tiny-", "organism-")) or (near and "/" not in name and not Path(name).exists()):
        return UnsupportedModelError(
            f"unknown model name {name!r}.{close_matches(name, registered)} Registered names: "
            f"{', '.join(registered)}; or pass a directory or hub id."
        )
    return None


def hub_config_message(name: str, reason: str) -> str:
    """The message of a hub id whose config cannot be read locally (vlmbind never downloads)."""
    return (f"could not read a model config from hub id {name!r}: {reason}. vlmbind never downloads: fetch the "
            f"checkpoint into the Hugging Face cache first (huggingface-cli download {name}) or pass a directory "
            "saved with save_pretrained.")
