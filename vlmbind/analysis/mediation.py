"""Head-level causal mediation (VSM): patch one head's output from the counterfactual run into the clean run.

Per head h of layer l, z_h (the slice of the ``o_proj`` input belonging to h, never the projection's output, which
mixes heads) is taken from the counterfactual run at the pair's patch positions and written into the clean run.
The score (docs/methods.md section 4) is

    s = (M(c*)[a*] - M(c*)[a]) - (M(c)[a*] - M(c)[a])

the patched run's logit difference between the counterfactual answer a* and the clean answer a at the last position,
minus the same difference in the unpatched clean run; scores are averaged over pairs (mean, standard error, count).
Multi-token answers are scored at their first differing token: when a and a* share leading tokens (low-entropy
pairs with the same colour, e.g. ``red square`` vs ``red circle``), the shared tokens are appended to both prompts
and the scored position (and a last-token patch) moves to the new last token.

``method="naive"`` is the reference: one full forward per (pair, layer, head). Faster exact methods must reproduce
its numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.numpy import save
from scipy.stats import false_discovery_control, spearmanr, ttest_1samp
from tqdm.auto import tqdm

from ..core.checks import check_head_list
from ..core.choices import CONDITIONS, METHODS  # noqa: F401  (CONDITIONS: public here too)
from ..core.choices import LOCATE_CHECKPOINT as CHECKPOINT  # noqa: F401  (public here too)
from ..core.errors import InputError
from ..core.io import write_bytes_atomic, write_json_atomic, write_text_atomic
from ..core.results import Result, read_csv_columns, read_json_object, register_result, require_keys
from ..engine.alignment import check_alignment
from ..engine.patching import METHOD_FUNCTIONS, PatchTask
from ..viz import head_heatmap, write_html_atomic

# first-order and path estimates, reported beside exact scores of their top candidates
ESTIMATES = ("attribution", "integrated_gradients", "atp_star")


def answer_token_ids(tokenizer: Any, answer: str, answer_cf: str, separator: str = " ") -> tuple[list[int], int, int]:
    """``(shared prefix ids, id of a, id of a*)`` at the first token where ``separator + answer`` and
    ``separator + answer_cf`` differ (``separator``: :meth:`vlmbind.engine.vlm.VLM.answer_separator`).

    Raises:
        InputError: the answers tokenise identically (nothing to score).
    """
    a = tokenizer(separator + answer, add_special_tokens=False)["input_ids"]
    b = tokenizer(separator + answer_cf, add_special_tokens=False)["input_ids"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return [int(t) for t in a[:i]], int(x), int(y)
    raise InputError(f"answers {answer!r} and {answer_cf!r} have no differing token: nothing to score")


N_BOOTSTRAP = 2000
SIGNIFICANCE = 0.05


def fewest_pairs_for_significance(alpha: float) -> int:
    """The smallest number of pairs at which an exact two-sided sign-flip test of the mean can reach p < ``alpha``:
    its smallest p, every pair's sign agreeing one way or the other, is 2 / 2**n."""
    n = 1
    while 2 / 2**n >= alpha:
        n += 1
    return n


# below this many pairs a t-test's small p rests on its normality assumption alone: no head is called significant
MIN_PAIRS_FOR_SIGNIFICANCE = fewest_pairs_for_significance(SIGNIFICANCE)
UNCERTAINTY_COLUMNS = ("ci_low", "ci_high", "p_value", "q_value", "significant")
UNCERTAINTY_METHOD = (f"95% percentile bootstrap interval of the mean over pairs ({N_BOOTSTRAP} resamples, seed 0); "
                      "two-sided one-sample t-test against 0 per head, Benjamini-Hochberg over all heads; "
                      f"significant: q < {SIGNIFICANCE} and at least {MIN_PAIRS_FOR_SIGNIFICANCE} pairs (below that "
                      f"an exact sign-flip test cannot reach p < {SIGNIFICANCE})")
# how an estimate is named beside its exact score in the ranking text
ESTIMATE_LABELS = {"attribution": "attribution", "integrated_gradients": "ig", "atp_star": "atp*"}


def head_uncertainty(per_pair: np.ndarray, *, n_boot: int = N_BOOTSTRAP, seed: int = 0) -> dict[str, np.ndarray]:
    """``L H`` arrays ``ci_low``, ``ci_high`` (95% percentile bootstrap of the mean over pairs, seeded), ``p_value``
    (two-sided one-sample t-test of the pairs' scores against 0), ``q_value`` (Benjamini-Hochberg over every head)
    and ``significant`` (q < 0.05, with at least :data:`MIN_PAIRS_FOR_SIGNIFICANCE` pairs). A head whose pairs all
    score the same (zero variance) has no t statistic and is never significant: p = 1 whatever the score. With fewer
    than :data:`MIN_PAIRS_FOR_SIGNIFICANCE` pairs nothing is significant (p and q are still computed); with fewer than
    2 the intervals are NaN."""
    n, shape = per_pair.shape[0], per_pair.shape[1:]
    if n < 2:
        nan = np.full(shape, np.nan)
        return {"ci_low": nan, "ci_high": nan.copy(), "p_value": np.ones(shape), "q_value": np.ones(shape),
                "significant": np.zeros(shape, bool), "zero_variance": np.zeros(shape, bool)}
    flat = per_pair.reshape(n, -1).astype(np.float64)
    # resampling pairs with replacement = multinomial counts over the pairs: one matrix product for every resample
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=n_boot)
    boot = counts @ flat / n
    low, high = np.percentile(boot, [2.5, 97.5], axis=0)
    # scores equal to float precision are constant: no variance to test against, so no evidence either way (scipy's
    # t statistic would be noise, or infinite)
    constant = flat.std(0) <= 1e-12 * np.abs(flat).max(0)
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p = ttest_1samp(flat, 0.0, axis=0).pvalue
    p = np.where(constant, 1.0, p)
    p = np.where(np.isnan(p), 1.0, p)
    q = false_discovery_control(p, method="bh")
    return {"ci_low": low.reshape(shape), "ci_high": high.reshape(shape), "p_value": p.reshape(shape),
            "q_value": q.reshape(shape),
            "significant": ((q < SIGNIFICANCE) & (n >= MIN_PAIRS_FOR_SIGNIFICANCE)).reshape(shape),
            "zero_variance": (constant & (flat[0] != 0)).reshape(shape)}


def tied_groups(ranked: Sequence[tuple[int, int]], values: np.ndarray) -> list[list[str]]:
    """Groups of consecutive heads of ``ranked`` (as ``"L.H"``) whose ``values`` are equal to 1e-9 of the largest
    ``|values|`` (NaN ignored): their places in the ranking are arbitrary."""
    finite = np.abs(values[~np.isnan(values)])
    scale = max(float(finite.max()) if finite.size else 0.0, 1e-30)
    groups: list[list[str]] = []
    for (l, h), (pl, ph) in zip(ranked[1:], ranked[:-1]):
        if abs(values[l, h] - values[pl, ph]) <= 1e-9 * scale:
            if groups and groups[-1][-1] == f"{pl}.{ph}":
                groups[-1].append(f"{l}.{h}")
            else:
                groups.append([f"{pl}.{ph}", f"{l}.{h}"])
    return groups


@register_result
@dataclass
class HeadScores(Result):
    """Per-head mediation scores.

    Attributes:
        condition: the pairs' condition.
        method: how the scores were computed.
        model: the model's name.
        per_pair: ``N L H`` score of every pair for every head.
        seconds: wall time of the computation.
        pair_ids: the pairs, in order.
        verified: ``attribution`` only: ``N L H`` exact scores of the top candidates (NaN elsewhere).
        skipped: examples that gave no pair (attention_swap traces without two usable points).
        prompt_format: how the scene pairs were prompted (``raw`` or ``chat``).
        predictions: :func:`prediction_check` of the pairs, where it was measured (how often the model's own
            predictions are the answers the scores compare).
        pairs_file: the pairs file the pairs were read from (``vlmbind locate --pairs``), or None.
        canvas: the generated pairs' canvas, ``{"image_size", "grid", "image_size_from"}``
            (:func:`vlmbind.analysis.evaluation.stimulus_defaults`), or None where it was not recorded.
        answer_casing: :func:`answer_casing` of the pairs, where it was measured (the scores use the answers'
            lower-case tokens; this says how often the model would rather start with a capital).
        scored_heads: the heads scored when ``--layers`` / ``--heads`` restricted the run (the others hold 0, not a
            measurement); None when every head was scored.
        table: a result loaded from its files (:meth:`load`): the saved per-head table; ``per_pair`` is then None
            and the means, standard errors and counts come from the table.
    """

    kind = "locate"
    reproduced_files = ("scores.csv", "heatmap.html")
    marker_files = ("scores.csv", "summary.json")
    figure_name = "heatmap"
    table_name = "scores.csv"

    condition: str
    method: str
    model: str
    per_pair: np.ndarray | None
    seconds: float = 0.0
    pair_ids: list[str] = field(default_factory=list)
    verified: np.ndarray | None = None
    skipped: list[str] = field(default_factory=list)
    prompt_format: str = "raw"
    answer_casing: dict[str, Any] | None = None
    predictions: dict[str, Any] | None = None
    pairs_file: str | None = None
    canvas: dict[str, Any] | None = None
    scored_heads: list[str] | None = None
    table: pd.DataFrame | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HeadScores:
        """The scores saved in ``directory`` (``scores.csv`` and ``summary.json``): per-head means, standard errors
        and counts, without the per-pair scores (they are not saved)."""
        directory = Path(directory)
        frame = read_csv_columns(directory / "scores.csv", ("layer", "head", "score", "stderr", "n"))
        summary = read_json_object(directory / "summary.json")
        require_keys(summary, ("condition", "method", "model", "n"), directory / "summary.json")
        return cls(condition=summary["condition"], method=summary["method"], model=summary["model"], per_pair=None,
                   seconds=summary.get("seconds", 0.0), pair_ids=summary.get("pair_ids", []),
                   skipped=summary.get("skipped_examples", []), prompt_format=summary.get("prompt_format", "raw"),
                   answer_casing=summary.get("answer_casing"), predictions=summary.get("predictions"),
                   pairs_file=summary.get("pairs_file"), canvas=summary.get("canvas"),
                   scored_heads=summary.get("scored_heads"), table=frame)

    def _saved(self, column: str) -> np.ndarray:
        """``L H`` of one column of the loaded table (NaN where a head has no row)."""
        t = self.table
        grid = np.full((int(t["layer"].max()) + 1, int(t["head"].max()) + 1), np.nan)
        grid[t["layer"].to_numpy(int), t["head"].to_numpy(int)] = t[column].to_numpy(float)
        return grid

    @property
    def n(self) -> int:
        if self.per_pair is None:
            return int(self.table["n"].iloc[0]) if len(self.table) else 0
        return int(self.per_pair.shape[0])

    @property
    def scores(self) -> np.ndarray:
        """``L H`` mean score."""
        if self.per_pair is None:
            return self._saved("score")
        return self.per_pair.mean(0)

    @property
    def stderr(self) -> np.ndarray:
        """``L H`` standard error of the mean (0 with one pair)."""
        if self.per_pair is None:
            return self._saved("stderr")
        if self.n < 2:
            return np.zeros(self.per_pair.shape[1:])
        return self.per_pair.std(0, ddof=1) / math.sqrt(self.n)

    def uncertainty(self) -> dict[str, np.ndarray]:
        """:func:`head_uncertainty` of the per-pair scores (from the saved table when loaded, no head significant on
        fewer than :data:`MIN_PAIRS_FOR_SIGNIFICANCE` pairs whatever it says; NaN / not significant where a table
        written before these columns existed lacks them)."""
        if self.per_pair is None:
            if not set(UNCERTAINTY_COLUMNS) <= set(self.table.columns):
                shape = self._saved("score").shape
                return {"ci_low": np.full(shape, np.nan), "ci_high": np.full(shape, np.nan),
                        "p_value": np.ones(shape), "q_value": np.ones(shape), "significant": np.zeros(shape, bool)}
            out = {c: self._saved(c) for c in UNCERTAINTY_COLUMNS}
            # a table saved before the minimum existed may call heads significant on too few pairs
            out["significant"] = (out["significant"] == 1) & (self.n >= MIN_PAIRS_FOR_SIGNIFICANCE)
            return out
        cache = self.__dict__.get("_uncertainty")
        if cache is None or cache[0] is not self.per_pair:
            cache = (self.per_pair, head_uncertainty(self.per_pair))
            self.__dict__["_uncertainty"] = cache
        return cache[1]

    def significant_top(self, k: int | None = None) -> list[tuple[int, int]]:
        """The heads whose score differs from 0 (BH q < 0.05, on at least :data:`MIN_PAIRS_FOR_SIGNIFICANCE` pairs),
        by decreasing score; the first ``k`` when given."""
        sig = self.uncertainty()["significant"]
        ranked = [h for h in self.top(sig.size) if sig[h]]
        return ranked if k is None else ranked[:k]

    def _shows_exact(self) -> bool:
        """Whether some head has an exact score beside this result's estimate (``verified``)."""
        exact = self.verified_scores
        return exact is not None and not np.isnan(exact).all()

    def ranking_legend(self) -> str:
        """What each entry of :meth:`ranking_text` holds, for the words that introduce it."""
        if self._shows_exact():
            return (f"{ESTIMATE_LABELS.get(self.method, self.method)} estimate and exact mean [95% interval], "
                    f"verified heads by exact score, * estimate significant")
        return "mean [95% interval], * significant"

    def ranking_text(self, k: int = 5) -> str:
        """The top ``k`` heads with their means and 95% intervals, ``*`` on those significant after correction, and
        the ties among them (their order is the heads' index order, not evidence).

        With exact scores of the top candidates (``verified``, an estimate method), each head's estimate is shown
        beside its exact score, e.g. ``3.1 (ig +17.2 [...], exact +18.3 [...])``: the verified heads come first,
        ranked by exact score, then the unverified ones by estimate, and the ties are those of the exact scores.
        """
        u = self.uncertainty()

        def name_and_mean(l: int, h: int) -> tuple[str, str]:
            star = "*" if u["significant"][l, h] else ""
            return f"{l}.{h}{star}", f"{self.scores[l, h]:+.3f} [{u['ci_low'][l, h]:+.3f}, {u['ci_high'][l, h]:+.3f}]"

        if not self._shows_exact():
            text = ", ".join("{} ({})".format(*name_and_mean(l, h)) for l, h in self.top(k))
            ties = self.ties(k)
        else:
            exact = self.verified_scores
            low, high = self.verified_intervals()
            ranked = self.top(self.scores.size)
            verified = sorted((lh for lh in ranked if not np.isnan(exact[lh])), key=lambda lh: -exact[lh])
            shown = (verified + [lh for lh in ranked if np.isnan(exact[lh])])[:k]
            label = ESTIMATE_LABELS.get(self.method, self.method)
            entries = []
            for l, h in shown:
                name, estimate = name_and_mean(l, h)
                checked = ("exact not verified" if np.isnan(exact[l, h]) else
                           f"exact {exact[l, h]:+.3f} [{low[l, h]:+.3f}, {high[l, h]:+.3f}]")
                entries.append(f"{name} ({label} {estimate}, {checked})")
            text = ", ".join(entries)
            ties = tied_groups([lh for lh in shown if lh in verified], exact)
        return text + ("; tied: " + "; ".join(" = ".join(group) for group in ties) if ties else "")

    def ties(self, k: int = 10) -> list[list[str]]:
        """Groups of heads (``"L.H"``) among the top ``k`` whose mean scores are equal (to 1e-9 of the largest):
        their places in the ranking are arbitrary."""
        return tied_groups(self.top(k), self.scores)

    def significance_note(self, pairs_option: str = "--n-pairs") -> str | None:
        """What to tell a user when no head is called significant at this many pairs (None when some head is): that
        there are too few pairs for any test to be trusted (fewer than :data:`MIN_PAIRS_FOR_SIGNIFICANCE`), or that
        no head separates from zero. ``pairs_option`` is the flag that sets the number of pairs."""
        fewest = MIN_PAIRS_FOR_SIGNIFICANCE
        if self.n < fewest:
            more = (f"add pairs to {self.pairs_file} ({fewest} or more)" if self.pairs_file
                    else f"rerun with {pairs_option} {fewest} or more")
            return (f"{self.n} pair{'' if self.n == 1 else 's'}: too few to call any head significant (at least "
                    f"{fewest} are needed: with n pairs an exact sign-flip test cannot reach p < {SIGNIFICANCE} "
                    f"below {fewest}); {more}")
        if self.significant_top():
            return None
        flat = int(self.uncertainty().get("zero_variance", np.zeros(1, bool)).sum())  # a loaded table has none
        return (f"no head's score differs from 0 at n = {self.n} pairs (t-test, Benjamini-Hochberg q < "
                f"{SIGNIFICANCE} over {self.scores.size} heads): the ranking is not evidence; add pairs "
                + (f"to {self.pairs_file}" if self.pairs_file else f"({pairs_option} above {self.n})")
                + (f"; {flat} head(s) score the same nonzero value on every pair (zero variance: not testable; "
                   f"check that the pairs differ)" if flat else ""))

    def significance_text(self, k: int = 10, pairs_option: str = "--n-pairs") -> str:
        """One line on significance: :meth:`significance_note` when no head is significant, else the first ``k``
        significant heads with the sign of their mean score (``+3.1, -4.1``), said to be the estimate's for an
        estimate method."""
        note = self.significance_note(pairs_option)
        if note:
            return note
        heads = self.significant_top()
        listed = ", ".join(f"{'-' if self.scores[l, h] < 0 else '+'}{l}.{h}" for l, h in heads[:k])
        more = f" and {len(heads) - k} more" if len(heads) > k else ""
        whose = f" by the {ESTIMATE_LABELS.get(self.method, self.method)} estimate" if self.method in ESTIMATES else ""
        return f"significant{whose} (BH q < {SIGNIFICANCE}, sign of the mean): {listed}{more}"

    @property
    def verified_scores(self) -> np.ndarray | None:
        """``L H`` mean exact score of the verified heads (NaN for the others), or None."""
        if self.per_pair is None and "exact_score" in self.table.columns:
            return self._saved("exact_score")
        return None if self.verified is None else self.verified.mean(0)

    def verified_intervals(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(low, high)``: ``L H`` 95% percentile bootstrap interval over pairs of each verified head's exact score
        (as :func:`head_uncertainty`), NaN at the heads not verified and where a loaded table lacks the columns;
        None without verification."""
        exact = self.verified_scores
        if exact is None:
            return None
        if self.per_pair is None:
            if {"exact_ci_low", "exact_ci_high"} <= set(self.table.columns):
                return self._saved("exact_ci_low"), self._saved("exact_ci_high")
            return np.full(exact.shape, np.nan), np.full(exact.shape, np.nan)
        low, high = np.full(exact.shape, np.nan), np.full(exact.shape, np.nan)
        checked = ~np.isnan(exact)
        if checked.any():
            u = head_uncertainty(self.verified[:, checked])
            low[checked], high[checked] = u["ci_low"], u["ci_high"]
        return low, high

    def to_frame(self) -> pd.DataFrame:
        if self.per_pair is None:
            return self.table.copy()
        layers, heads = self.scores.shape
        u = self.uncertainty()
        rows = [
            {"layer": layer, "head": head, "score": float(self.scores[layer, head]),
             "stderr": float(self.stderr[layer, head]), "n": self.n,
             **{c: (bool(u[c][layer, head]) if c == "significant" else float(u[c][layer, head]))
                for c in UNCERTAINTY_COLUMNS}}
            for layer in range(layers) for head in range(heads)
        ]
        if self.verified is not None:
            exact, (low, high) = self.verified_scores, self.verified_intervals()
            for row in rows:
                at = row["layer"], row["head"]
                row.update(exact_score=float(exact[at]), exact_ci_low=float(low[at]), exact_ci_high=float(high[at]))
        return pd.DataFrame(rows)

    def top(self, k: int = 5) -> list[tuple[int, int]]:
        """The ``k`` heads with the largest mean score, as ``(layer, head)``."""
        order = np.argsort(-self.scores, axis=None, kind="stable")[:k]
        return [tuple(int(v) for v in np.unravel_index(i, self.scores.shape)) for i in order]

    def figure(self) -> Any:
        frame = self.to_frame()
        return head_heatmap(frame, value="score", title=f"{self.condition} mediation ({self.method})",
                            model=self.model, n=self.n, signed=True,
                            mark="significant" if "significant" in frame.columns else None)

    def summary(self) -> dict[str, Any]:
        out = {"condition": self.condition, "method": self.method, "model": self.model, "n": self.n,
               "seconds": self.seconds, "top_heads": [f"{l}.{h}" for l, h in self.top(10)],
               "pair_ids": self.pair_ids, "prompt_format": self.prompt_format,
               "significant_heads": [f"{l}.{h}" for l, h in self.significant_top()],
               **({"tied_top_heads": ties} if (ties := self.ties(10)) else {}),
               "uncertainty": UNCERTAINTY_METHOD}
        note = self.significance_note()
        if note:
            out["significance_note"] = note
        if self.skipped:
            out["skipped_examples"] = self.skipped
        if self.answer_casing is not None:
            out["answer_casing"] = self.answer_casing
        if self.predictions is not None:
            out["predictions"] = self.predictions
        if self.pairs_file is not None:
            out["pairs_file"] = self.pairs_file
        if self.canvas is not None:
            out["canvas"] = self.canvas
        if self.scored_heads is not None:
            out["scored_heads"] = self.scored_heads
        if self.verified is not None:
            exact, (low, high) = self.verified_scores, self.verified_intervals()
            heads = [tuple(int(v) for v in idx) for idx in np.argwhere(~np.isnan(exact))]
            out["verified"] = [{"head": f"{l}.{h}", self.method: float(self.scores[l, h]),
                                "exact": float(exact[l, h]),
                                "exact_ci": [None if np.isnan(v) else float(v) for v in (low[l, h], high[l, h])]}
                               for l, h in heads]
            if len(heads) > 2:
                out["verified_spearman"] = float(spearmanr([self.scores[h] for h in heads],
                                                           [exact[h] for h in heads]).statistic)
        return out

    @classmethod
    def concat(cls, parts: Sequence[HeadScores], *, seconds: float = 0.0, skipped: Sequence[str] = ()) -> HeadScores:
        """One result from results on consecutive blocks of the same run's pairs (a sweep's ranks), in order."""
        first = parts[0]
        verified = None if first.verified is None else np.concatenate([p.verified for p in parts])
        return cls(condition=first.condition, method=first.method, model=first.model,
                   per_pair=np.concatenate([p.per_pair for p in parts]), seconds=seconds,
                   pair_ids=[i for p in parts for i in p.pair_ids], verified=verified, skipped=list(skipped),
                   prompt_format=first.prompt_format, answer_casing=first.answer_casing,
                   predictions=first.predictions, pairs_file=first.pairs_file, canvas=first.canvas,
                   scored_heads=first.scored_heads)

    def recall(self, reference: HeadScores, k: int = 10) -> float:
        """Share of ``reference``'s top-``k`` heads that are also in this result's top-``k``."""
        return len(set(self.top(k)) & set(reference.top(k))) / k

    def save(self, out: str | os.PathLike) -> Path:
        """Write ``scores.csv``, ``heatmap.html`` and ``summary.json`` atomically."""
        out = Path(out)
        write_text_atomic(self.to_frame().to_csv(index=False), out / "scores.csv")
        write_html_atomic(self.figure(), out / "heatmap.html")
        write_json_atomic(self.summary(), out / "summary.json")
        return out


def answer_casing(vlm: Any, pairs: Sequence[Any], prompt_format: str | None = None,
                  batch_size: int = 16) -> dict[str, Any] | None:
    """How often the model would rather start its answer with a capital: on each pair's clean prompt, the logit of
    the capitalised answer's first token (``Red``) against the lower-case one (``red``) that the scores use.

    Returns:
        ``{"n", "capitalised_preferred", "share", "mean_logit_gap", "rule"}`` (gap: capitalised minus lower-case),
        or None for pairs without a scene answer or answers that have no distinct capitalised token.
    """
    pairs = [p for p in pairs if hasattr(p, "clean") and isinstance(getattr(p, "answer", None), str)]
    chat = vlm.prompt_format(prompt_format) == "chat"
    rows = []
    for p in pairs:
        lower = vlm.answer_ids(p.answer, chat)[0]
        upper = vlm.answer_ids(p.answer[:1].upper() + p.answer[1:], chat)[0]
        if upper != lower:
            rows.append((p, lower, upper))
    if not rows:
        return None
    gaps = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = vlm.prepare([p.clean.image for p, _, _ in chunk], [p.clean.prompt for p, _, _ in chunk], chat=chat)
        with torch.no_grad():
            logits = vlm.logits(batch, at=[batch.seq_len - 1])[:, 0].float()
        for r, (_, lower, upper) in enumerate(chunk):
            gaps.append(float(logits[r, upper] - logits[r, lower]))
    preferred = sum(g > 0 for g in gaps)
    return {"n": len(gaps), "capitalised_preferred": int(preferred), "share": preferred / len(gaps),
            "mean_logit_gap": float(np.mean(gaps)),
            "rule": "clean prompt, first answer token: logit of the capitalised answer's token minus the lower-case "
                    "one's (the scores use the lower-case tokens)"}


def pairs_digest(pairs: Sequence[Any]) -> str:
    """A SHA-256 of what the pairs hold (prompts, images, answers, patch; a trace pair's tokens), so that a checkpoint
    is never resumed on other pairs that share its ids (another seed, an edited pairs file)."""
    digest = hashlib.sha256()
    for p in pairs:
        digest.update(str(p.id).encode())
        if hasattr(p, "clean"):
            for e in (p.clean, p.counterfactual):
                digest.update(e.prompt.encode())
                digest.update(e.image.tobytes())
            digest.update(json.dumps([p.answer, p.answer_counterfactual, p.counterfactual.answer, p.patch],
                                     sort_keys=True).encode())
        else:
            digest.update(json.dumps([getattr(p, "trace", None), getattr(p, "step_a", None),
                                      getattr(p, "step_b", None)]).encode())
    return digest.hexdigest()


PREDICTION_RULE = ("greedy top token at the scored position (after any shared answer prefix): on the clean input is "
                   "it a's first differing token, on the counterfactual input the token of its own answer "
                   "(answer_on_counterfactual; for the swap conditions the target, for a user's pair a* unless given)")


def prediction_check(vlm: Any, pairs: Sequence[Any], prompt_format: str | None = None,
                     examples: int = 5) -> dict[str, Any] | None:
    """How often the model's own predictions are the answers the scores compare: on each pair's clean input, is the
    top token at the scored position a's (a misspelt or unlikely answer shows here), and on the counterfactual
    input, its own answer's.

    Returns:
        ``{"n", "clean_is_a", "clean_rate", "counterfactual_checked", "counterfactual_is_own", "counterfactual_rate",
        "failing": [{"id", "expected", "predicted"}, ...] (the first ``examples`` clean failures), "per_pair": [{"id",
        "clean_predicted", "clean_is_a", "counterfactual_predicted", "counterfactual_is_own"}], "rule"}``; None for
        pairs that are not scene-like (trace pairs).
    """
    pairs = [p for p in pairs if hasattr(p, "clean") and isinstance(getattr(p, "answer", None), str)]
    if not pairs:
        return None
    chat = vlm.prompt_format(prompt_format) == "chat"
    tokenizer = vlm.adapter.tokenizer
    rows, failing = [], []
    separator = vlm.answer_separator(chat)
    for p in pairs:
        clean, counterfactual, _, a, _ = aligned_scene_pair(vlm, p, prompt_format)
        prefix = answer_token_ids(tokenizer, p.answer, p.answer_counterfactual, separator)[0]
        own = tokenizer(separator + p.counterfactual.answer, add_special_tokens=False)["input_ids"]
        own_token = int(own[len(prefix)]) if own[:len(prefix)] == prefix and len(own) > len(prefix) else None
        with torch.no_grad():
            top_clean = int(vlm.logits(clean, at=[clean.seq_len - 1])[0, 0].argmax())
            top_cf = int(vlm.logits(counterfactual, at=[counterfactual.seq_len - 1])[0, 0].argmax())
        row = {"id": p.id, "clean_predicted": tokenizer.decode([top_clean]), "clean_is_a": top_clean == a,
               "counterfactual_predicted": tokenizer.decode([top_cf]),
               "counterfactual_is_own": None if own_token is None else top_cf == own_token}
        rows.append(row)
        if top_clean != a and len(failing) < examples:
            failing.append({"id": p.id, "expected": tokenizer.decode([a]), "predicted": row["clean_predicted"]})
    checked = [r for r in rows if r["counterfactual_is_own"] is not None]
    clean_ok = sum(r["clean_is_a"] for r in rows)
    cf_ok = sum(bool(r["counterfactual_is_own"]) for r in checked)
    return {"n": len(rows), "clean_is_a": clean_ok, "clean_rate": clean_ok / len(rows),
            "counterfactual_checked": len(checked), "counterfactual_is_own": cf_ok,
            "counterfactual_rate": cf_ok / len(checked) if checked else None, "failing": failing,
            "per_pair": rows, "rule": PREDICTION_RULE}


def aligned_scene_pair(vlm: Any, pair: Any, prompt_format: str | None = None) -> tuple[Any, Any, np.ndarray, int, int]:
    """``(clean, counterfactual, positions, a, a_star)`` of one scene pair: both batches lined up token for token,
    the clean row's patch positions, and the first differing answer tokens. When the answers share leading tokens
    (``red square`` vs ``red circle``) those tokens are appended to both sides by id, and the scored position (and a
    last-token patch) moves to the new last token. ``prompt_format`` None is the model's
    (:attr:`~vlmbind.engine.vlm.VLM.active_prompt_format`), as in :func:`locate`."""
    chat = vlm.prompt_format(prompt_format) == "chat"
    try:
        prefix, a, a_star = answer_token_ids(vlm.adapter.tokenizer, pair.answer, pair.answer_counterfactual,
                                             vlm.answer_separator(chat))
    except InputError as exc:  # name the pair: the answers are the user's
        raise InputError(f"pair {pair.id!r}: {exc}") from None
    aligned = check_alignment(vlm, [pair], chat=chat)
    clean, counterfactual, positions = aligned.clean, aligned.counterfactual, aligned.positions[0]
    if prefix:
        clean, counterfactual = vlm.extend(clean, prefix), vlm.extend(counterfactual, prefix)
        if pair.patch.get("kind") == "last":
            positions = np.array([clean.index[0].last_position])
    return clean, counterfactual, positions, a, a_star


def scene_task(vlm: Any, pair: Any, layers: Sequence[int], prompt_format: str | None = None) -> PatchTask:
    """The :class:`PatchTask` of one scene pair (:func:`aligned_scene_pair`, in the model's prompt format unless
    ``prompt_format`` says otherwise): the aligned clean prompt, its patch positions, the counterfactual's z of
    ``layers`` there, and the first differing answer tokens."""
    clean, counterfactual, positions, a, a_star = aligned_scene_pair(vlm, pair, prompt_format)
    return PatchTask.from_counterfactual(vlm, clean, counterfactual, positions, layers, a, a_star)


def locate(vlm: Any, pairs: Any, *, method: str = "exact", layers: list[int] | None = None,
           heads: Any = None, progress: bool = False, verify_top: int = 10, checkpoint: str | os.PathLike | None = None,
           gather: Callable[[np.ndarray], np.ndarray] | None = None, prompt_format: str | None = None,
           **method_kwargs: Any) -> HeadScores:
    """Score every head (or those of ``layers``) on counterfactual pairs.

    Args:
        vlm: a loaded VLM.
        pairs: a :class:`~vlmbind.stimuli.PairSet`, a list of pairs (one condition), or
            :class:`~vlmbind.engine.patching.PatchTask` objects with a ``condition`` given by ``method_kwargs``.
        method: ``"exact"`` (fast, equal to naive), ``"naive"`` (one forward per pair and head) or
            ``"attribution"`` (first-order estimate, AtP: one forward-backward per pair) or
            ``"integrated_gradients"`` (the gradient averaged along the path from the clean to the counterfactual
            head outputs, EAP-IG style: ``steps`` forward-backward passes per pair, ``steps=8`` by default).
        layers: restrict to these layers (others score 0, unmeasured: the summary's ``scored_heads`` says which).
        heads: restrict to these heads (``"2.3,3.1"`` or pairs; with ``layers``, those of them in ``layers``).
        progress: show a progress bar (``naive`` and ``exact``: one step per head and pair).
        verify_top: ``attribution`` and ``integrated_gradients``: also run ``exact`` on this many top candidates (``verified``), so the estimate
            is always reported beside its exact counterpart; 0 skips it.
        checkpoint: a file the per-pair scores are written to (atomically) after every pair; an existing one from
            the same run (model, method, condition, layers, pairs) is continued from, so a killed run resumes where
            it stopped and ends with the same numbers. It is removed when the run completes.
        gather: ``attribution``: maps these pairs' ``N L H`` estimates to the estimates the verification candidates
            are chosen from (a sweep's ranks pool theirs through it, :func:`vlmbind.analysis.sweeps.locate`); None:
            their own.
        prompt_format: ``raw`` or ``chat`` (None: the model's, :attr:`vlmbind.engine.vlm.VLM.active_prompt_format`);
            scene pairs only, recorded in the summary.
        method_kwargs: passed to the method (``exact``: ``max_rows``, ``memory_budget``; ``integrated_gradients``:
            ``steps``).

    Raises:
        InputError: unknown method, no pairs, or pairs of several conditions.
    """
    if method not in METHOD_FUNCTIONS:
        raise InputError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    pairs_in, pairs = pairs, list(pairs)
    if not pairs:
        raise InputError("locate needs at least one counterfactual pair")
    conditions = {getattr(p, "condition", None) for p in pairs}
    if len(conditions) != 1:
        raise InputError(f"pairs mix conditions {sorted(map(str, conditions))}; locate one condition at a time")
    n_layers, n_heads = vlm.n_layers, vlm.n_heads
    layers = list(range(n_layers)) if layers is None else [int(l) for l in layers]
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise InputError(f"layers {bad} are out of range; the model has layers 0..{n_layers - 1}")
    only = heads
    heads = [(l, h) for l in layers for h in range(n_heads)]
    if only is not None:
        wanted = set(check_head_list(only, n_layers=n_layers, n_heads=n_heads))
        heads = [lh for lh in heads if lh in wanted]
        if not heads:
            raise InputError(f"none of the heads {sorted(wanted)} lies in the layers {layers}")
    fmt = vlm.prompt_format(prompt_format)
    compute = METHOD_FUNCTIONS[method]
    per_pair = np.zeros((len(pairs), n_layers, n_heads))
    start = time.perf_counter()
    run_key = {"model": vlm.name, "method": method, "condition": str(next(iter(conditions))), "layers": layers,
               **({} if only is None else {"heads": [f"{l}.{h}" for l, h in heads]}),
               "pairs": [p.id for p in pairs], "content": pairs_digest(pairs), "prompt_format": fmt}
    done = resume_checkpoint(checkpoint, run_key, per_pair)
    tasks: dict[int, Any] = {}
    by_head = method in ("naive", "exact")  # a real checkpoint's pair can take minutes: count heads, not pairs
    bar = tqdm(total=(len(pairs) - done) * (len(heads) if by_head else 1), desc=f"locate ({method})",
               unit="head" if by_head else "pair", disable=not progress)
    for i, pair in enumerate(pairs):
        if i < done:
            continue
        task = pair.task(vlm, layers) if hasattr(pair, "task") else scene_task(vlm, pair, layers, fmt)
        clean, patched = compute(vlm, task, heads, **method_kwargs, **({"progress": bar.update} if by_head else {}))
        if not by_head:
            bar.update(1)
        for (layer, head), value in zip(heads, patched):
            per_pair[i, layer, head] = value - clean
        if method in ESTIMATES and verify_top > 0:
            tasks[i] = task
        if checkpoint is not None:
            save_checkpoint(checkpoint, run_key, per_pair[: i + 1])
    verified = None
    if method in ESTIMATES and verify_top > 0:
        candidates = top_candidates(per_pair if gather is None else gather(per_pair), heads, verify_top)
        verified = verify_heads(vlm, pairs, layers, candidates, per_pair.shape[1:], tasks, fmt)
    bar.close()
    if checkpoint is not None:
        Path(checkpoint).unlink(missing_ok=True)
    return HeadScores(condition=next(iter(conditions)), method=method, model=vlm.name, per_pair=per_pair,
                      seconds=time.perf_counter() - start, pair_ids=[p.id for p in pairs], verified=verified,
                      skipped=list(getattr(pairs_in, "skipped", [])), prompt_format=fmt,
                      scored_heads=(None if len(heads) == n_layers * n_heads else [f"{l}.{h}" for l, h in heads]))


def top_candidates(per_pair: np.ndarray, heads: Sequence[tuple[int, int]], k: int) -> list[tuple[int, int]]:
    """The ``k`` heads of ``heads`` with the largest mean of ``per_pair`` (``N L H``): attribution's candidates."""
    mean = per_pair.mean(0)
    return sorted(heads, key=lambda lh: -mean[lh])[:k]


def verify_heads(vlm: Any, pairs: Sequence[Any], layers: Sequence[int], candidates: Sequence[tuple[int, int]],
                 shape: tuple[int, int], tasks: dict[int, PatchTask] | None = None,
                 prompt_format: str = "raw") -> np.ndarray:
    """Exact scores of ``candidates`` on every pair: ``N L H`` with NaN at the heads not verified.

    Args:
        vlm: a loaded VLM.
        pairs: the pairs (scene pairs or objects with ``task``).
        layers: the layers the tasks capture.
        candidates: ``(layer, head)`` to verify.
        shape: ``(L, H)`` of the model.
        tasks: already built tasks by pair index (built here when missing).
        prompt_format: how scene pairs are prompted when their tasks are built here.
    """
    tasks = tasks or {}
    verified = np.full((len(pairs), *shape), np.nan)
    for i, pair in enumerate(pairs):
        task = tasks.get(i) or (pair.task(vlm, layers) if hasattr(pair, "task")
                                else scene_task(vlm, pair, layers, prompt_format))
        clean, patched = METHOD_FUNCTIONS["exact"](vlm, task, list(candidates))
        for (layer, head), value in zip(candidates, patched):
            verified[i, layer, head] = value - clean
    return verified


def save_checkpoint(path: str | os.PathLike, run_key: dict[str, Any], done: np.ndarray) -> None:
    """The finished pairs' scores, exactly (float64), with what identifies the run."""
    write_bytes_atomic(save({"per_pair": np.ascontiguousarray(done)}, metadata={"run": json.dumps(run_key)}), path)


def resume_checkpoint(path: str | os.PathLike | None, run_key: dict[str, Any], per_pair: np.ndarray) -> int:
    """Fill ``per_pair`` from a checkpoint of the same run; returns how many pairs are done (0 without one).

    Raises:
        InputError: the checkpoint belongs to another run (model, method, condition, layers or pairs differ).
    """
    if path is None or not Path(path).is_file():
        return 0
    with safe_open(str(path), framework="numpy") as f:
        saved = json.loads(f.metadata()["run"])
        done = f.get_tensor("per_pair")
    diff = [k for k in run_key if saved.get(k) != run_key[k]]
    if diff:
        raise InputError(f"checkpoint {path} is from another run ({', '.join(diff)} differ); remove it or use another "
                         "output directory")
    per_pair[: len(done)] = done
    return len(done)
