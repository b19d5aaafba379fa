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


def _grid(tmp_path, n_layers, n_heads, drop=(), extra=(), name="scores.csv"):
    rows = [f"{l},{h},{0.1 * (l * n_heads + h)}" for l in range(n_layers) for h in range(n_heads) if (l, h) not in drop]
    path = tmp_path / name
    path.write_text("layer,head,score\n" + "\n".join([*rows, *extra]) + "\n")
    return path


FIX = "run vlmbind locate on this --model and pass the scores.csv it writes"


def test_a_table_of_another_shape_names_the_flag_the_file_what_it_covers_and_the_fix(tmp_path):
    """A 4 x 4 table for a model of 7 layers x 4 heads: the message says how many heads it covers, its extent and
    the model's shape; a table missing two rows names them; a row at layer == n_layers names its line."""
    small = _grid(tmp_path, 4, 4, name="small.csv")
    with pytest.raises(UserFileError) as err:
        read_scores(small, n_layers=7, n_heads=4)
    assert str(err.value) == (f"--scores {str(small)!r} covers 16 of the model's 28 heads: layers 0..3 x heads 0..3, "
                              f"the model has 7 x 4 (missing 4.0, 4.1, 4.2, 4.3 and 8 more); {FIX}")
    holes = _grid(tmp_path, 7, 4, drop=((0, 0), (6, 3)), name="holes.csv")
    with pytest.raises(UserFileError, match=r"covers 26 of the model's 28 heads: layers 0\.\.6 x heads 0\.\.3, the "
                                            r"model has 7 x 4 \(missing 0\.0, 6\.3\)"):
        read_scores(holes, n_layers=7, n_heads=4)
    wide = _grid(tmp_path, 7, 5, name="wide.csv")
    with pytest.raises(UserFileError, match=r"line 6: head 4 is outside the model \(heads 0\.\.3\): the table covers "
                                            r"layers 0\.\.6 x heads 0\.\.4, the model has 7 x 4"):
        read_scores(wide, n_layers=7, n_heads=4)
    one_layer_more = _grid(tmp_path, 8, 4, name="eight_layers.csv")
    with pytest.raises(UserFileError, match=r"line 30: layer 7 is outside the model \(layers 0\.\.6\): the table "
                                            r"covers layers 0\.\.7 x heads 0\.\.3"):
        read_scores(one_layer_more, n_layers=7, n_heads=4)
    assert len(read_scores(_grid(tmp_path, 7, 4), n_layers=7, n_heads=4)) == 28
    assert len(read_scores(small)) == 16  # without the model's shape there is nothing to cover


@pytest.mark.parametrize("table", [
    "layer,head,score\n0,0,inf\n",
    "layer,head,score\n0,x,1\n",
    "layer,head,score\n0,0,1\n0,0,2\n",
    "layer,head,score\n",
    "a,b\n1,2\n",
    'layer,head,score\n"0,0,1\n',
])
def test_every_refusal_of_a_scores_table_names_the_flag_the_file_and_the_fix(tmp_path, table):
    path = tmp_path / "scores.csv"
    path.write_text(table)
    with pytest.raises(UserFileError) as err:
        read_scores(path, n_layers=1, n_heads=1)
    message = str(err.value)
    assert message.startswith(f"--scores {str(path)!r} ") and message.endswith(FIX) and "\n" not in message
