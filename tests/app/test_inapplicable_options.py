"""An option that does not apply to the run it is given to is refused, never silently ignored: exit 2 with one line
``vlmbind: error: ...`` naming the flag, why it does not apply and what to do, nothing written, and, where the
refusal needs no model, no torch imported (each case runs in a fresh interpreter, as ``test_cli_startup.py`` does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny-qwen2_5_vl"

# runs the command in a fresh interpreter, then writes whether it imported torch to $VLMBIND_TEST_MODULES
_RUN = (
    "import json, os, sys\n"
    "from vlmbind.app.commands import main\n"
    "code = main(sys.argv[1:])\n"
    "with open(os.environ['VLMBIND_TEST_MODULES'], 'w') as f:\n"
    "    json.dump('torch' in sys.modules, f)\n"
    "sys.exit(code)\n"
)

# label -> (arguments, the flag the line names, whether the refusal needs the model (then torch is imported))
CASES = {
    "ablate --top-k with --heads": (["ablate", "--model", TINY, "--task", "scene", "--heads", "0.0", "--top-k", "2"],
                                    "--top-k", False),
    "ablate --bottom-by with --heads": (["ablate", "--model", TINY, "--task", "scene", "--heads", "0.0",
                                         "--bottom-by", "score"], "--bottom-by", False),
    "ablate --scores-from-any-model with --heads": (["ablate", "--model", TINY, "--task", "scene", "--heads", "0.0",
                                                     "--scores-from-any-model"], "--scores-from-any-model", False),
    "ablate --renormalize with --mode zero": (["ablate", "--model", TINY, "--task", "scene", "--heads", "0.0",
                                               "--mode", "zero", "--renormalize"], "--renormalize", False),
    # the mode is zero by default for heads located on id_selection
    "ablate --renormalize with the scores' default mode": (["ablate", "--model", TINY, "--task", "scene", "--scores",
                                                            "{scores}", "--renormalize"], "--renormalize", False),
    "edit --top-k with --heads": (["edit", "--model", TINY, "--heads", "0.0", "--top-k", "2"], "--top-k", False),
    "edit --scores-from-any-model with --heads": (["edit", "--model", TINY, "--heads", "0.0",
                                                   "--scores-from-any-model"], "--scores-from-any-model", False),
    "eval --point-frame on scene": (["eval", "--model", TINY, "--task", "scene", "--point-frame", "pixels"],
                                    "--point-frame", False),
    "eval --point-frame on query": (["eval", "--model", TINY, "--task", "query", "--point-frame", "pixels"],
                                    "--point-frame", False),
    "eval --point-frame with --data": (["eval", "--model", TINY, "--data", "{task}", "--point-frame", "pixels"],
                                       "--point-frame", False),
    "validate --naive-heads without naive": (["validate", "--model", TINY, "--methods", "exact", "--naive-heads",
                                              "3"], "--naive-heads", False),
    "validate --ig-steps without integrated_gradients": (["validate", "--model", TINY, "--methods", "exact,naive",
                                                          "--ig-steps", "4"], "--ig-steps", False),
    "validate --alpha without id_selection heads": (["validate", "--model", TINY, "--heads", "id_retrieval=1.0",
                                                     "--alpha", "1,2"], "--alpha", False),
    "validate --n-estimate, --edit-positions without id_selection heads": (
        ["validate", "--model", TINY, "--heads", "feature_retrieval=1.0", "--n-estimate", "64", "--edit-positions",
         "last"], "--n-estimate, --edit-positions", False),
    # a reference read from a training record that plants no id_selection head
    "validate --alpha with such a --reference": (["validate", "--model", TINY, "--reference", "{record}", "--alpha",
                                                  "1"], "--alpha", True),
    # nothing planted in the tiny model and no reference: no probe runs
    "validate --n-probe without reference heads": (["validate", "--model", TINY, "--n-probe", "64"], "--n-probe",
                                                   True),
    "validate --n-track on scene heads": (["validate", "--model", TINY, "--heads", "id_selection=1.0", "--n-track",
                                           "8"], "--n-track", False),
    "validate scene options on search heads": (["validate", "--model", TINY, "--heads", "search=1.0", "--alpha",
                                                "1", "--objects", "3"], "--objects, --alpha", False),
    "validate --edge-pairs on search heads": (["validate", "--model", TINY, "--heads", "search=1.0", "--edge-pairs",
                                               "2"], "--edge-pairs", False),
    "demo --validate-model with --no-validate": (["demo", "--model", TINY, "--no-validate", "--validate-model",
                                                  "organism-vsm"], "--validate-model", False),
    "demo --pairs with --no-causal --no-validate": (["demo", "--model", TINY, "--no-causal", "--no-validate",
                                                     "--pairs", "4"], "--pairs", False),
    "demo --eval-n with every part skipped": (["demo", "--model", TINY, "--no-causal", "--no-validate",
                                               "--no-representations", "--eval-n", "8"], "--eval-n", False),
    "demo --probe-n with --no-validate --no-representations": (["demo", "--model", TINY, "--no-validate",
                                                                "--no-representations", "--probe-n", "64"],
                                                               "--probe-n", False),
}


def _files(tmp_path: Path) -> dict[str, str]:
    """The files some cases point at: a scores table located on id_selection, a task file, a training record."""
    located = tmp_path / "located"
    located.mkdir()
    (located / "scores.csv").write_text("layer,head,score\n" + "".join(f"{l},{h},{4 * l + h}\n" for l in range(4)
                                                                      for h in range(4)))
    (located / "summary.json").write_text(json.dumps({"model": TINY, "condition": "id_selection"}))
    task = tmp_path / "mine"
    task.mkdir()
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(task / "red.png")
    (task / "task.jsonl").write_text(json.dumps({"image": "red.png", "prompt": "colour?", "answer": "red"}) + "\n")
    record = tmp_path / "record"
    record.mkdir()
    (record / "vlmbind_training.json").write_text(json.dumps({"planted": {"feature_retrieval": ["1.0"]}}))
    return {"scores": str(located / "scores.csv"), "task": str(task), "record": str(record)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_option_that_does_not_apply_is_refused(case, tmp_path):
    argv, flag, needs_model = CASES[case]
    files = _files(tmp_path)
    out = tmp_path / "out"
    argv = [a.format(**files) for a in argv] + ["--out", str(out)]
    env = os.environ | {"VLMBIND_TEST_MODULES": str(tmp_path / "torch.json"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlmbind: error: "), lines
    assert proc.stdout == ""
    line = lines[0]
    assert line.startswith(f"vlmbind: error: {flag} "), line
    assert ("does not apply" in line or "do not apply" in line or "applies to" in line) and "drop" in line, line
    assert not out.exists() and not (tmp_path / "runs").exists()  # nothing written
    imported_torch = json.loads((tmp_path / "torch.json").read_text())
    if not needs_model:
        assert not imported_torch, f"{case}: refused after importing torch"
