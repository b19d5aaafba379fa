"""`ablate --scores` and `edit --scores` with a table of another model's shape: exit 2 with one line naming the flag,
the file, what the table covers against the model's shape, and the fix."""

from __future__ import annotations

import pytest
from helpers import shared_organism


@pytest.mark.parametrize("command", [["edit", "--top-k", "2"], ["ablate", "--task", "scene", "--n", "2"]])
def test_a_scores_table_of_another_shape_is_refused_naming_flag_file_and_fix(tmp_path, capsys, command):
    from vlmbind.cli import main

    vlm = shared_organism("organism-vsm")
    assert (vlm.n_layers, vlm.n_heads) == (7, 4)
    table = tmp_path / "tiny_scores.csv"  # as a 4 x 4 model's locate leaves it
    table.write_text("layer,head,score\n" + "".join(f"{l},{h},{l + h / 10}\n" for l in range(4) for h in range(4)))
    out = tmp_path / "out"
    assert main([*command[:1], "--model", "organism-vsm", "--scores", str(table), *command[1:], "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
    assert err == [f"vlmbind: error: --scores {str(table)!r} covers 16 of the model's 28 heads: layers 0..3 x heads "
                   f"0..3, the model has 7 x 4 (missing 4.0, 4.1, 4.2, 4.3 and 8 more); run vlmbind locate on this "
                   f"--model and pass the scores.csv it writes"]
    assert not (out / "results.json").exists()
