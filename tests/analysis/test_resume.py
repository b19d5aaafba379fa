"""kill -9 at a point part-way through a long run, resume it, and get the bytes an uninterrupted run writes: the
activation capture, the probes and the organism trainer (locate's own test is in test_mediation.py, eval's in
test_evaluate.py). Nothing half-written is read as complete: temp files are never listed, and a run left behind is
refused unless ``--resume`` says to continue it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "vlmbind.cli"]


def kill_when(cmd: list[str], ready: Callable[[], bool], timeout: float = 180) -> None:
    """Start ``cmd``, SIGKILL it as soon as ``ready()`` holds, and fail if it finished first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    deadline = time.time() + timeout
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    code = proc.wait()
    assert code == -signal.SIGKILL, f"the run ended by itself (code {code}): {proc.stderr.read().decode()[-500:]}"


def same_files(ref: Path, run: Path, skip: tuple[str, ...] = ()) -> None:
    names = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file() and p.name not in skip)
    assert names == sorted(p.relative_to(run) for p in run.rglob("*") if p.is_file() and p.name not in skip)
    for name in names:
        assert (run / name).read_bytes() == (ref / name).read_bytes(), name


def test_killed_probe_run_resumes_to_an_identical_table(tmp_path):
    args = ["probe", "--model", "organism-p2a", "--n-train", "24", "--n-val", "8", "--n-test", "8", "--epochs", "2",
            "--family", "linear,quadratic", "--json"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run([*CLI, *args, "--out", str(ref)], check=True, capture_output=True, env=ENV)
    checkpoint = run / "probe.partial.json"
    kill_when([*CLI, *args, "--out", str(run)], checkpoint.exists)
    rows = json.loads(checkpoint.read_text())["rows"]
    assert 1 <= len(rows) < 6 and not (run / "probe.csv").exists()
    again = subprocess.run([*CLI, *args, "--out", str(run)], capture_output=True, text=True, env=ENV)
    assert again.returncode == 2 and "--resume" in again.stderr.strip().splitlines()[-1]
    subprocess.run([*CLI, *args, "--out", str(run), "--resume"], check=True, capture_output=True, env=ENV)
    assert (run / "probe.csv").read_bytes() == (ref / "probe.csv").read_bytes()
    assert not checkpoint.exists()
    same_files(ref / "activations", run / "activations")
    # a checkpoint of other options is refused, not mixed in
    (run / "probe.partial.json").write_text(json.dumps({"run": {"model": "x"}, "rows": rows}))
    other = subprocess.run([*CLI, *args, "--out", str(run), "--resume"], capture_output=True, text=True, env=ENV)
    assert other.returncode == 2 and "another run" in other.stderr


CAPTURE = """
import sys
import vlmbind as vb
from vlmbind.stimuli import scenes
vlm = vb.load("tiny-qwen2_5_vl")
data = scenes.scene_description(12, 0, n_objects=3)
vb.capture(vlm, data, ["blocks.1.hook_resid_post", "blocks.*.attn.hook_z"], out=sys.argv[1], shard_size=2,
           resume=len(sys.argv) > 2)
"""


def test_killed_capture_resumes_to_identical_files(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    cmd = [sys.executable, "-c", CAPTURE]
    subprocess.run([*cmd, str(ref)], check=True, capture_output=True, env=ENV)

    def some_shards() -> bool:
        try:
            manifest = json.loads((run / "manifest.json").read_text())
        except (OSError, ValueError):
            return False
        return len(manifest.get("shards", [])) >= 2

    kill_when([*cmd, str(run)], some_shards)
    manifest = json.loads((run / "manifest.json").read_text())
    assert 2 <= len(manifest["shards"]) < 6
    refused = subprocess.run([*cmd, str(run)], capture_output=True, text=True, env=ENV)
    assert refused.returncode != 0 and "resume" in refused.stderr
    subprocess.run([*cmd, str(run), "resume"], check=True, capture_output=True, env=ENV)
    same_files(ref, run)
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_killed_training_resumes_to_identical_weights(tmp_path):
    from vlmbind.organisms import TrainConfig

    config = TrainConfig(tasks={"scene": 1.0}, task_options={"scene": {"objects": [2, 3]}}, steps=8, batch_size=8,
                         image_size=56, warmup=2, lr=3e-3, checkpoint_every=1, keep_checkpoints=2, eval_every=0,
                         model={"layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1, "vision_depth": 1,
                                "vision_hidden": 32, "vision_heads": 2})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config.to_dict()))
    cmd = [sys.executable, "-m", "vlmbind.organisms", "--config", str(path), "--quiet", "--threads", "1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run([*cmd, "--out", str(ref)], check=True, capture_output=True, env=ENV)
    kill_when([*cmd, "--out", str(run)], lambda: (run / "checkpoint-000003").is_dir())
    subprocess.run([*cmd, "--out", str(run), "--resume"], check=True, capture_output=True, env=ENV)
    last = "checkpoint-000008"
    state = {d: json.loads((d / last / "trainer_state.json").read_text()) for d in (ref, run)}
    assert state[ref]["losses"] == state[run]["losses"] and state[ref]["step"] == 8
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(ref / last / name), load_file(run / last / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in ref.iterdir())
