"""The report's opening findings: sentences built from the results' own numbers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from vlmbind.analysis import HeadScores
from vlmbind.analysis.edits import EditResult
from vlmbind.app.report import findings


def test_findings_quote_the_best_edited_alpha_never_alpha_0():
    """The edit sentence quotes the alpha with the highest efficacy among the edited ones; alpha 0 adds nothing, so
    even when its efficacy (0.9 here: answers that already name the object at t) tops every real edit (0.5 at
    alpha 1, 0.7 at alpha 2), the sentence names alpha 2 and its efficacy."""
    rows = [{"alpha": alpha, "arm": arm, "n": 20, "efficacy": eff if arm == "edit" else 0.1, "original": 0.0,
             "other": 0.0, "described": 0.0, "changed": 0.0}
            for alpha, eff in ((0.0, 0.9), (1.0, 0.5), (2.0, 0.7)) for arm in ("edit", "control", "random_direction")]
    edit = EditResult(model="m", heads=[(1, 0)], alphas=[0.0, 1.0, 2.0], rows=rows, records=[], clean_accuracy=1.0,
                      alpha0_identical=True, n_estimate=8, n_eval=20, n_used=20, skipped={}, norms={}, params={},
                      seed=0, clean_names_t=0.9, estimate={})
    per_pair = np.random.default_rng(0).normal(size=(4, 2, 2))
    causal = SimpleNamespace(model="m", scores={"id_selection": HeadScores("id_selection", "exact", "m", per_pair)},
                             ablations={}, edit=edit)
    sentence = next(s for s in findings(causal) if "position-ID edit" in s)
    assert "switches 0.70 [" in sentence and "at its best alpha (2)" in sentence, sentence
