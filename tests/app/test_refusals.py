"""Refusals a user causes by the machine or the files at hand, not by a malformed argument: a busy ``ui`` port, an
attention implementation whose package is not installed, text files saved in another encoding than UTF-8, and
Ctrl-C, whose line says what the run kept and the command that resumes it.

Like ``test_bad_input.py``: exit 2 with one line ``vlmbind: error: <reason>`` and nothing printed before it (Ctrl-C
keeps its exit code 130), or a named error from the Python API.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import socket

import pandas as pd
import pytest
from PIL import Image

import vlmbind as vb
from vlmbind import cli
from vlmbind import stimuli as vbs
from vlmbind.analysis import evaluation, mediation
from vlmbind.app.commands import interrupted
from vlmbind.core import kept
from vlmbind.core.userfiles import UserFileError, read_csv_columns, read_json_object, read_scores
from vlmbind.engine import activations, loading, parallel
from vlmbind.stimuli import StimulusError

TINY = "tiny-qwen2_5_vl"


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    assert lines[0].startswith("vlmbind: error: "), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# vlmbind ui on a port another program holds
# ----------------------------------------------------------------------------------------------------------------
def test_ui_refuses_a_busy_port_before_loading_or_printing(capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(loading, "load", no_load)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = cli.main(["ui", "--model", "tiny-qwen2_vl", "--port", str(port)])
        captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == ""
    line = one_error_line(captured.err)
    assert f"--port {port} is already in use" in line
    suggested = re.search(r"pass --port (\d+)", line)
    assert suggested and int(suggested.group(1)) != port, line


def test_ui_refuses_a_host_that_is_not_this_machine(capsys, monkeypatch):
    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    # 203.0.113.0/24 is TEST-NET-3: never an address of this machine
    code = cli.main(["ui", "--model", "tiny-qwen2_vl", "--host", "203.0.113.7", "--port", "8123"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "--host 203.0.113.7 is not an address of this machine" in one_error_line(captured.err)


# ----------------------------------------------------------------------------------------------------------------
# --attn-implementation whose package is not installed
# ----------------------------------------------------------------------------------------------------------------
needs_no_flash_attn = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                                         reason="flash-attn is installed here")


@needs_no_flash_attn
def test_attn_implementation_not_installed_exits_2_before_building(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(loading.tiny, "build", lambda *a, **k: pytest.fail("the model was built"))
    out = tmp_path / "out"
    code = cli.main(["demo", "--model", TINY, "--attn-implementation", "flash_attention_2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == ""
    line = one_error_line(captured.err)
    for needle in ("--attn-implementation flash_attention_2", "flash-attn", "not installed",
                   "--attn-implementation eager", "--attn-implementation sdpa"):
        assert needle in line, f"{needle!r} not in {line!r}"
    assert not out.exists() or not any(out.rglob("*"))


@needs_no_flash_attn
def test_attn_import_error_at_load_is_an_input_error(monkeypatch):
    """Where the early check passes (here: told the package can run), transformers' ImportError at build time
    becomes the same kind of named error."""
    monkeypatch.setitem(loading.ATTN_PACKAGES, "flash_attention_2", ("flash-attn", "flash_attn", lambda: True))
    with pytest.raises(vb.InputError, match=r"--attn-implementation flash_attention_2 cannot run here \(.*"
                                            r"FlashAttention.*\); pass --attn-implementation eager or "
                                            r"--attn-implementation sdpa instead"):
        vb.load(TINY, attn_implementation="flash_attention_2")


# ----------------------------------------------------------------------------------------------------------------
# text files in another encoding than UTF-8
# ----------------------------------------------------------------------------------------------------------------
PROMPTS = [{"image": "a.png", "prompt": "what colour is it ?"}, {"image": "a.png", "prompt": "décris la scène :"}]


@pytest.fixture
def image_folder(tmp_path):
    Image.new("RGB", (16, 16), "red").save(tmp_path / "a.png")
    return tmp_path


def prompts_text() -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in PROMPTS)


def test_prompts_file_in_utf16_is_refused_naming_the_file(image_folder):
    path = image_folder / "prompts16.jsonl"
    path.write_text(prompts_text(), encoding="utf-16")  # what Windows editors call "Unicode"
    with pytest.raises(StimulusError, match=r"prompts file '.*prompts16.jsonl' is UTF-16 text, not UTF-8; save it "
                                            r"as UTF-8"):
        vbs.user_images(image_folder, path)


def test_prompts_file_in_latin1_is_refused_naming_the_line(image_folder):
    path = image_folder / "prompts1252.jsonl"
    path.write_text(prompts_text(), encoding="latin-1")
    column = prompts_text().splitlines()[1].index("é") + 1
    with pytest.raises(StimulusError, match=rf"prompts file '.*prompts1252.jsonl' line 2 is not UTF-8 text \(byte "
                                            rf"0xe9 at column {column}, .*Latin-1.*\); save it as UTF-8"):
        vbs.user_images(image_folder, path)


def test_prompts_file_with_a_utf8_byte_order_mark_is_read(image_folder):
    path = image_folder / "prompts_bom.jsonl"
    path.write_text(prompts_text(), encoding="utf-8-sig")
    assert [e.prompt for e in vbs.user_images(image_folder, path)] == [r["prompt"] for r in PROMPTS]


SCORES = "layer,head,score,note\n0,0,0.5,rouge\n0,1,0.25,bleu clair\n1,0,0.125,vert foncé\n1,1,0.0,noir\n"


def test_user_tables_and_json_in_other_encodings_are_refused(tmp_path):
    (tmp_path / "scores16.csv").write_text(SCORES, encoding="utf-16")
    (tmp_path / "scores1252.csv").write_text(SCORES, encoding="cp1252")
    (tmp_path / "summary1252.json").write_text(json.dumps({"condition": "sélection"}, ensure_ascii=False),
                                               encoding="latin-1")
    with pytest.raises(UserFileError, match=r"--scores '.*scores16.csv' is UTF-16 text, not UTF-8; save it as UTF-8"):
        read_scores(tmp_path / "scores16.csv")
    with pytest.raises(UserFileError, match=r"--scores '.*scores1252.csv' line 4 is not UTF-8 text \(byte 0xe9 at "
                                            r"column 20,"):
        read_scores(tmp_path / "scores1252.csv")
    with pytest.raises(UserFileError, match=r"line 4 is not UTF-8 text"):
        read_csv_columns(tmp_path / "scores1252.csv", ("layer", "head"))
    with pytest.raises(UserFileError, match=r"summary1252.json' line 1 is not UTF-8 text \(byte 0xe9 at column 17,"):
        read_json_object(tmp_path / "summary1252.json")


def test_user_tables_with_a_utf8_byte_order_mark_are_read(tmp_path):
    (tmp_path / "scores.csv").write_text(SCORES, encoding="utf-8-sig")
    frame = read_scores(tmp_path / "scores.csv", n_layers=2, n_heads=2)
    assert list(frame.columns) == ["layer", "head", "score", "note"]
    pd.testing.assert_series_equal(frame["note"], pd.Series(["rouge", "bleu clair", "vert foncé", "noir"]),
                                   check_names=False)
    (tmp_path / "x.json").write_text('{"a": "é"}', encoding="utf-8-sig")
    assert read_json_object(tmp_path / "x.json") == {"a": "é"}


# ----------------------------------------------------------------------------------------------------------------
# Ctrl-C: what is kept, and the command that resumes
# ----------------------------------------------------------------------------------------------------------------
def interrupt_after(monkeypatch, module, name: str, calls: int) -> None:
    """Make ``module.name`` (a checkpoint writer) raise KeyboardInterrupt once it has written ``calls`` times."""
    real, written = getattr(module, name), []

    def write_then_interrupt(*args, **kwargs):
        real(*args, **kwargs)
        written.append(1)
        if len(written) == calls:
            raise KeyboardInterrupt

    monkeypatch.setattr(module, name, write_then_interrupt)


def test_ctrl_c_in_locate_says_what_is_kept_and_how_to_resume(tmp_path, capsys, monkeypatch):
    out = tmp_path / "locate out"  # a space: the resume line must quote it
    argv = ["locate", "--model", TINY, "--condition", "id_retrieval", "--n-pairs", "3", "--out", str(out), "--json"]
    interrupt_after(monkeypatch, mediation, "save_checkpoint", 2)
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 130
    assert captured.out == ""
    resume = shlex.join(["vlmbind", *argv, "--resume"])
    assert one_error_line(captured.err) == (f"vlmbind: error: interrupted; 2 of 3 pairs kept in "
                                            f"{out / 'locate.partial.safetensors'}; resume with: {resume}")
    # the line's command resumes the run
    monkeypatch.undo()
    assert cli.main(shlex.split(resume)[1:]) == 0
    assert (out / "scores.csv").is_file() and not (out / "locate.partial.safetensors").exists()


def test_ctrl_c_in_eval_counts_the_kept_batches(tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval"
    argv = ["eval", "--model", TINY, "--task", "scene", "--n", "5", "--batch-size", "2", "--out", str(out),
            "--resume", "--json"]
    interrupt_after(monkeypatch, evaluation, "_append_batch", 1)
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 130 and captured.out == ""
    # --resume was given already: the line repeats the command as it was
    resume = shlex.join(["vlmbind", *argv])
    assert one_error_line(captured.err) == (f"vlmbind: error: interrupted; 2 of 5 examples (1 batch) kept in "
                                            f"{out / 'eval.partial.jsonl'}; resume with: {resume}")


def test_kept_work_of_captures_probes_and_damaged_files(tmp_path):
    assert kept.CAPTURE_MANIFEST == activations.MANIFEST and kept.PARTS_DIR == parallel.PARTS
    assert kept.kept_work(tmp_path) == []
    (tmp_path / "activations").mkdir()
    (tmp_path / "activations" / "manifest.json").write_text(json.dumps({"n": 10, "shards": [{"n": 4}, {"n": 4}]}))
    (tmp_path / "probe.partial.json").write_text(json.dumps({"run": {"sites": ["a", "b"], "families": ["linear"]},
                                                             "rows": [{"site": "a"}]}))
    assert kept.kept_work(tmp_path, tmp_path / "probe.partial.json") == [
        f"1 of 2 probes kept in {tmp_path / 'probe.partial.json'}",
        f"the activations of 8 of 10 examples kept in {tmp_path / 'activations'}"]
    (tmp_path / "locate.partial.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    assert kept.kept_work(tmp_path / "nowhere", tmp_path / "locate.partial.safetensors") == [
        f"partial results kept in {tmp_path / 'locate.partial.safetensors'}"]


def test_ctrl_c_before_anything_is_kept_or_in_a_command_without_checkpoints(tmp_path):
    assert interrupted(argparse.Namespace(), ["demo"]) == "interrupted"
    args = argparse.Namespace(kept_in=(tmp_path, tmp_path / "locate.partial.safetensors"), resume=False)
    assert interrupted(args, ["locate"]) == "interrupted before anything was kept"
