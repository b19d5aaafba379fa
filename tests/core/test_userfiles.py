"""Score tables handed in by a user: every row checked against the model's shape and for finite numbers."""

from __future__ import annotations

import pytest

from vlmbind.core.userfiles import UserFileError, read_scores


def _table(tmp_path, last_row, n_layers=4, n_heads=2):
    rows = [f"{l},{h},{0.1 * (l * n_heads + h)}" for l in range(n_layers) for h in range(n_heads)]
    path = tmp_path / "scores.csv"
    path.write_text("layer,head,score\n" + "\n".join([*rows[:-1], last_row]) + "\n")
    return path


def test_layers_and_heads_run_from_0_to_the_models_count_minus_1(tmp_path):
    """A model with 4 layers of 2 heads has layers 0..3 and heads 0..1: layer 3 / head 1 are read, layer 4 / head 2
    (equal to the counts) are outside the model, named with their line (the header is line 1, the last row line 9)."""
    frame = read_scores(_table(tmp_path, "3,1,0.5"), n_layers=4, n_heads=2)
    assert (int(frame["layer"].max()), int(frame["head"].max()), len(frame)) == (3, 1, 8)
    with pytest.raises(UserFileError, match=r"line 9: layer 4 is outside the model \(layers 0\.\.3\)"):
        read_scores(_table(tmp_path, "4,1,0.5"), n_layers=4, n_heads=2)
    with pytest.raises(UserFileError, match=r"line 9: head 2 is outside the model \(heads 0\.\.1\)"):
        read_scores(_table(tmp_path, "3,2,0.5"), n_layers=4, n_heads=2)


@pytest.mark.parametrize("score", ["inf", "-inf", "Infinity", "1e999", "nan", ""])
def test_a_score_that_is_not_a_finite_number_is_refused(tmp_path, score):
    """Infinite scores (written as inf or overflowing to it) are no more a ranking than NaN or a blank cell."""
    with pytest.raises(UserFileError, match=rf"line 9: score '{score}' is not a finite number"):
        read_scores(_table(tmp_path, f"3,1,{score}"), n_layers=4, n_heads=2)
    assert read_scores(_table(tmp_path, "3,1,-1e300"))["score"].iloc[-1] == -1e300  # large but finite is fine
