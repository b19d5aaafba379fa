"""Data-parallel sweeps and resumable evaluation: N processes give the single process's files byte for byte, ranks'
parts merge in item order, bad process counts exit 2, and a killed ``vlmbind eval`` resumes to identical files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import get_tiny

import vlmbind as vb
from vlmbind.analysis import locate, sweeps
from vlmbind.analysis.evaluation import CHECKPOINT, evaluate
from vlmbind.cli import main
from vlmbind.engine import parallel

S = vb.stimuli
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CMD = [sys.executable, "-m", "vlmbind"]
LOCATE = ["locate", "--model", "organism-p2a", "--condition", "feature_retrieval", "--n-pairs", "5", "--json"]
EVAL = ["eval", "--model", "organism-p2a", "--task", "query", "--n", "10", "--batch-size", "3", "--json"]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [7, 8, 20])
def test_blocks_cover_the_items_in_order(n, world):
    blocks = [parallel.block(n, rank, world) for rank in range(world)]
    assert [i for b in blocks for i in b] == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_world_size_follows_the_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parallel.world_size(3) == 3 and parallel.launched_world() is None
    with pytest.raises(vb.InputError, match="at least 1"):
        parallel.world_size(0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    assert parallel.launched_world() == (2, 4, 2)
    assert parallel.world_size(1) == 4 and parallel.world_size(4) == 4  # implied under a launcher
    with pytest.raises(vb.InputError, match="WORLD_SIZE=4"):
        parallel.world_size(2)


def test_bad_process_counts_exit_2_before_any_work(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert main([*LOCATE, "--out", out, "--processes", "0"]) == 2
    assert "--processes must be at least 1" in capsys.readouterr().err
    assert main([*LOCATE, "--out", out, "--processes", "6"]) == 2
    assert "--n-pairs 5 cannot be shared by 6 processes" in capsys.readouterr().err
    assert main([*EVAL, "--out", out, "--processes", "5"]) == 2  # 10 examples in batches of 3: 4 batches
    assert "makes 4 batches, fewer than --processes 5" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_leftovers_of_another_process_count_are_refused(tmp_path):
    single = tmp_path / "locate.partial.safetensors"
    parallel.check_leftovers(tmp_path, "locate", single, 2, resume=False)  # nothing there
    part = parallel.part_path(tmp_path, "locate-scores", 1, 3, ".safetensors")
    part.parent.mkdir()
    part.write_bytes(b"x")
    with pytest.raises(vb.InputError, match="--resume"):
        parallel.check_leftovers(tmp_path, "locate", single, 3, resume=False)
    with pytest.raises(vb.InputError, match="--processes 3"):
        parallel.check_leftovers(tmp_path, "locate", single, 2, resume=True)
    parallel.check_leftovers(tmp_path, "locate", single, 3, resume=True)
    parallel.remove_parts(tmp_path, "locate")
    assert not part.parent.exists()


def test_ranks_merge_to_the_single_process_scores(tmp_path):
    """Two ranks in threads (each with its own copy of the model, as separate processes would have) write parts that
    rank 0 merges into exactly the single-process result, through both rounds of attribution (estimate, then exact
    verification of candidates chosen from every rank's estimates); the exact method is covered by the subprocess
    test below."""
    method = "attribution"
    pairs = S.scene_pairs(5, "id_selection", 0, n_objects=3)
    kwargs = {"method": method, "verify_top": 3}
    ref = locate(get_tiny("tiny-qwen2_5_vl"), pairs, **kwargs)
    other = vb.load("tiny-qwen2_5_vl")
    errors = []

    def rank1() -> None:
        try:
            assert sweeps.locate(parallel.Group(rank=1, world=2), other, pairs, tmp_path, **kwargs) is None
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            errors.append(exc)

    thread = threading.Thread(target=rank1)
    thread.start()
    merged = sweeps.locate(parallel.Group(rank=0, world=2), get_tiny("tiny-qwen2_5_vl"), pairs, tmp_path, **kwargs)
    thread.join()
    assert not errors, errors
    np.testing.assert_array_equal(merged.per_pair, ref.per_pair)
    assert merged.pair_ids == ref.pair_ids and merged.to_frame().equals(ref.to_frame())
    assert np.isfinite(merged.verified).sum() == 5 * 3
    np.testing.assert_array_equal(merged.verified, ref.verified)
    # a part of another run is refused, not merged
    parts = sorted((tmp_path / parallel.PARTS).glob("locate-scores.rank*"))
    assert len(parts) == 2
    with pytest.raises(vb.InputError, match="another run"):
        sweeps.locate(parallel.Group(rank=0, world=2), get_tiny("tiny-qwen2_5_vl"), pairs[:4], tmp_path, **kwargs)


def test_two_processes_write_the_single_process_files(tmp_path, capsys):
    """`--processes 2` (vlmbind spawns rank 1) gives scores.csv, results.json and answers.jsonl byte-identical to one
    process, and leaves no parts behind."""
    ref, two = tmp_path / "ref", tmp_path / "two"
    assert main([*LOCATE, "--out", str(ref / "locate")]) == 0
    assert main([*EVAL, "--out", str(ref / "eval")]) == 0
    capsys.readouterr()
    for args, name in ((LOCATE, "locate"), (EVAL, "eval")):
        done = subprocess.run([*CMD, *args, "--out", str(two / name), "--processes", "2"], capture_output=True,
                              text=True, env=ENV, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads(done.stdout)  # rank 1 prints nothing: stdout is rank 0's JSON alone
        assert summary["processes"] == 2
        assert not (two / name / parallel.PARTS).exists()
    assert (two / "locate/scores.csv").read_bytes() == (ref / "locate/scores.csv").read_bytes()
    assert json.loads((two / "locate/summary.json").read_text())["pair_ids"] == \
        json.loads((ref / "locate/summary.json").read_text())["pair_ids"]
    for name in ("results.json", "answers.jsonl"):
        assert (two / "eval" / name).read_bytes() == (ref / "eval" / name).read_bytes()
    assert len((two / "eval/answers.jsonl").read_text().splitlines()) == 10


def test_two_processes_capture_the_single_process_shards(tmp_path, capsys):
    """`vlmbind probe --processes 2`: each rank captures its block of shards, rank 0 writes the manifest; the
    activation directory (every shard and the manifest) and probe.csv equal a one-process run's, byte for byte."""
    args = ["probe", "--model", "organism-p2a", "--n-train", "16", "--n-val", "8", "--n-test", "8", "--epochs", "2",
            "--shard-size", "8", "--json"]
    ref, two = tmp_path / "ref", tmp_path / "two"
    assert main([*args, "--out", str(ref)]) == 0
    capsys.readouterr()
    done = subprocess.run([*CMD, *args, "--out", str(two), "--processes", "2"], capture_output=True, text=True,
                          env=ENV, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["model"] == "organism-p2a"
    names = sorted(p.name for p in (ref / "activations").iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) == 4
    assert sorted(p.name for p in (two / "activations").iterdir()) == names  # no parts left behind
    for name in names:
        assert (two / "activations" / name).read_bytes() == (ref / "activations" / name).read_bytes(), name
    assert (two / "probe.csv").read_bytes() == (ref / "probe.csv").read_bytes()
    assert main([*args, "--out", str(tmp_path / "bad"), "--processes", "5"]) == 2
    assert "4 shards, fewer than --processes 5" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "bad"), "--shard-size", "0"]) == 2
    assert "--shard-size must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_killed_eval_resumes_to_identical_files(tmp_path, capsys):
    """kill -9 a `vlmbind eval` once its checkpoint holds some but not all batches, tear its last line, resume, and
    compare with an uninterrupted run."""
    args = ["eval", "--model", "organism-p2a", "--task", "query", "--n", "12", "--batch-size", "1", "--json"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main([*args, "--out", str(ref)]) == 0
    proc = subprocess.Popen([*CMD, *args, "--out", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=ENV)
    checkpoint = run / CHECKPOINT
    deadline = time.time() + 180

    def batches() -> int:
        return checkpoint.read_text().count("\n") - 1 if checkpoint.exists() else 0

    while batches() < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = batches()
    assert 2 <= done < 12 and not (run / "results.json").exists(), "the run must be killed part-way"
    with open(checkpoint, "ab") as fh:  # a write torn by the kill: never read as a finished batch
        fh.write(b'{"batch": %d, "records": [{"id": "x"' % done)
    capsys.readouterr()
    # without --resume the interrupted run is refused, not overwritten
    assert main([*args, "--out", str(run)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--out", str(run), "--resume"]) == 0
    for name in ("results.json", "answers.jsonl"):
        assert (run / name).read_bytes() == (ref / name).read_bytes()
    assert not checkpoint.exists()


def test_eval_checkpoint_of_another_run_is_refused(tmp_path):
    vlm = get_tiny("tiny-qwen2_5_vl")
    ds = S.binding_query(4, 0)
    path = tmp_path / CHECKPOINT
    full = evaluate(vlm, ds, batch_size=2)
    evaluate(vlm, S.binding_query(4, 1), batch_size=2, checkpoint=path)  # completes: removed
    assert not path.exists()
    path.write_text(json.dumps({"run": {"model": "other"}}) + "\n")
    with pytest.raises(vb.InputError, match="another run"):
        evaluate(vlm, ds, batch_size=2, checkpoint=path)
    path.write_text("not json\n")
    with pytest.raises(vb.InputError, match="not a vlmbind eval checkpoint"):
        evaluate(vlm, ds, batch_size=2, checkpoint=path)
    # a checkpoint with the first batch done: only the second batch is generated again
    from vlmbind.analysis.evaluation import run_key

    path.write_text(json.dumps({"run": run_key(vlm, list(ds), 2, False)}) + "\n"
                    + json.dumps({"batch": 0, "records": full.records[:2]}) + "\n")
    calls = []
    original = vlm.generate
    vlm.generate = lambda batch, **kw: calls.append(batch) or original(batch, **kw)
    try:
        resumed = evaluate(vlm, ds, batch_size=2, checkpoint=path)
    finally:
        del vlm.generate
    assert len(calls) == 1 and resumed.records == full.records
