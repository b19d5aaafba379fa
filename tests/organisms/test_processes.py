"""Training in two processes (``train(processes=2)``): the same run as one process, repeatable, resumable, and
failing cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_siit import _planting_config

from vlmbind.core.errors import TrainingError
from vlmbind.organisms.processes import RankSplit, sync_step
from vlmbind.organisms.siit.spec import SIITSpec
from vlmbind.organisms.training.config import TrainConfig
from vlmbind.organisms.training.run import train

# every kind of SIIT loss, on both ranks: readouts, attention losses, ablation strictness and necessity
EVERY_LOSS = {"alignments": {"feature_retrieval": ["1.1"], "id_selection": ["1.0", "0.3"], "id_retrieval": ["0.2"]},
              "pairs": 4, "objects": [3, 3], "aggregation_heads": ["0.3"], "position_layer": 0,
              "position_readout": "trained", "selection_weight": 1.0, "selection_attention_weight": 1.0,
              "retrieval_attention_weight": 1.0, "interchanged_selection_weight": 1.0, "source_grad": True,
              "gather_interchange_weight": 1.0, "gather_selection_weight": 1.0, "selecting_interchange_weight": 1.0,
              "strict_selection_weight": 1.0, "retrieval_readout_weight": 1.0, "gather_readout_weight": 1.0,
              "ablation_strict_weight": 1.0, "ablation_necessity_weight": 1.0,
              "ablation_strict_modes": ["zero", "mean", "role_mean"]}
FILES = ("model.safetensors", "position_probe.safetensors", "selection_probe.safetensors",
         "retrieval_probe.safetensors", "gather_probe.safetensors", "optimizer.safetensors")


def _config(steps: int = 8, **overrides) -> TrainConfig:
    fields = dict(steps=steps, eval_every=steps, checkpoint_every=steps, eval_size=8, siit=EVERY_LOSS,
                  attn_implementation="eager")
    return _planting_config(**{**fields, **overrides})


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name in FILES:
        if (checkpoint / name).is_file():
            out.update({f"{name}/{k}": v for k, v in load_file(str(checkpoint / name)).items()})
    return out


def _state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 8 SIIT steps in one process, in two, and in two stopped at step 3 and resumed."""
    root = tmp_path_factory.mktemp("processes")
    config = _config()
    one = train(config, root / "one", progress=False, threads=1)
    two = train(config, root / "two", progress=False, threads=1, processes=2)
    stopped = train(config, root / "resumed", progress=False, threads=1, processes=2, until=3)
    resumed = train(config, root / "resumed", progress=False, threads=1, processes=2, resume=True)
    return {"one": one, "two": two, "stopped": stopped, "resumed": resumed}


def test_two_processes_train_the_run_one_process_trains(runs):
    """Weights, readouts and AdamW's moments of the two-process run equal the one-process run's up to the order of
    float sums, and so does every logged loss part; the draws logged are the same strings."""
    one, two = runs["one"], runs["two"]
    a, b = _tensors(one.checkpoint), _tensors(two.checkpoint)
    assert set(a) == set(b) and any(k.startswith("selection_probe") for k in a)
    for key in a:
        scale = float(a[key].abs().max()) + 1e-8
        assert float((a[key] - b[key]).abs().max()) <= 1e-4 * scale, key
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    log_one, log_two = _state(one.checkpoint)["siit_losses"], _state(two.checkpoint)["siit_losses"]
    assert len(log_one) == len(log_two) == 8
    for p, q in zip(log_one, log_two):
        assert list(p) == list(q)  # the same parts, in the same order
        for key, value in p.items():
            assert q[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-5, abs=1e-7)), key
    # every rank's part was computed: both halves of the behaviour batch and both SIIT parts
    assert {"iit", "strict", "ablation_strict", "ablation_necessity", "behaviour", "position"} <= set(log_two[0])
    assert two.evals[-1]["tasks"] == one.evals[-1]["tasks"]
    assert _state(two.checkpoint)["processes"] == 2 and "processes" not in _state(one.checkpoint)
    assert two.step == 8 and two.wall_time_s > 0 and two.steps_per_s > 0


def test_a_two_process_run_repeats_and_resumes_bit_for_bit(runs):
    """The split is fixed by the config, so a two-process run stopped at step 3 and resumed ends with the tensors and
    losses of the uninterrupted two-process run, exactly."""
    two, resumed = runs["two"], runs["resumed"]
    assert runs["stopped"].step == 3 and resumed.step == 8
    a, b = _tensors(two.checkpoint), _tensors(resumed.checkpoint)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.losses == two.losses
    assert _state(resumed.checkpoint)["siit_losses"] == _state(two.checkpoint)["siit_losses"]


def test_behaviour_only_runs_split_rows_with_token_weights(tmp_path):
    """Without SIIT the behaviour batch is split by rows; with ``loss_norm="token"`` each half weighs by its answer
    tokens, so the two halves add up to the whole batch's loss (scene answers differ in length)."""
    config = _config(steps=4, siit=None, loss_norm="token", batch_size=7,
                     task_options={"scene": {"objects": [2, 3], "colours": ["red", "green", "blue"],
                                             "shapes": ["square", "circle", "star"]}})
    one = train(config, tmp_path / "one", progress=False, threads=1)
    two = train(config, tmp_path / "two", progress=False, threads=1, processes=2)
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    a, b = _tensors(one.checkpoint), _tensors(two.checkpoint)
    assert all(float((a[k] - b[k]).abs().max()) <= 1e-4 * (float(a[k].abs().max()) + 1e-8) for k in a)


@pytest.mark.parametrize("iit, strict, rows", [
    (1.0, 0.4, ([0, 1, 2, 3], [4, 5, 6])),   # both ranks have SIIT work: halves, rank 0 the larger one
    (1.0, 0.0, ([], list(range(7)))),        # no strictness: rank 1 takes the whole behaviour batch
    (0.0, 0.4, (list(range(7)), [])),        # no IIT: rank 0 takes it
])
def test_the_behaviour_batch_goes_where_the_siit_work_is_not(iit, strict, rows):
    spec = SIITSpec.from_value({"alignments": {"feature_retrieval": ["1.1"]}, "iit_weight": iit,
                                "strict_weight": strict})
    assert [list(RankSplit(rank=r).behaviour_rows(7, spec)) for r in (0, 1)] == list(rows)
    assert [list(RankSplit(rank=r).behaviour_rows(7, None)) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6]]
    assert RankSplit(rank=0).siit_parts() == ("iit",) and RankSplit(rank=1).siit_parts() == ("strict",)


class _PeerSplit(RankSplit):
    """A split whose all-reduce adds what the other rank would have sent (a fixed buffer)."""

    def __init__(self, peer: torch.Tensor):
        super().__init__(rank=0)
        object.__setattr__(self, "peer", peer)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor += self.peer
        return tensor


def test_sync_keeps_a_parameter_no_rank_reached_without_a_gradient():
    """A parameter with a gradient on either rank gets the sum; one with none on both keeps ``grad=None``, so AdamW
    skips it as it would in one process. Logged losses are summed where some rank logged them."""
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad = torch.tensor([1.0, 2.0])
    # the peer: a gradient for b only, a logged "strict" and a step loss of 3
    peer = torch.tensor([0.0, 0.0, 5.0, 6.0, 0.0, 0.0,  # gradients of a, b, c
                         0.0, 1.0, 0.0,  # which have one
                         0.0, 0.7, 0.0, 0.0, 1.0, 0.0,  # logged values, which were logged
                         3.0])
    split = _PeerSplit(peer)
    logged, total = sync_step(split, [a, b, c], {"iit": 0.25}, ("iit", "strict", "behaviour"), 1.5)
    assert a.grad.tolist() == [1.0, 2.0] and b.grad.tolist() == [5.0, 6.0] and c.grad is None
    assert logged == pytest.approx({"iit": 0.25, "strict": 0.7}) and total == pytest.approx(4.5)


def test_bad_process_requests_are_named(tmp_path):
    config = _config(steps=2)
    with pytest.raises(TrainingError, match="processes must be 1 or 2"):
        train(config, tmp_path / "a", progress=False, processes=3)
    with pytest.raises(TrainingError, match="single_loss=False"):
        train(_config(steps=2, siit={**EVERY_LOSS, "single_loss": False}), tmp_path / "b", progress=False,
              processes=2)
    with pytest.raises(TrainingError, match="share_image_features=False"):
        train(config, tmp_path / "c", progress=False, processes=2, share_image_features=False)


def _workers_left(out: Path) -> list[str]:
    """The training processes still running on the run directory ``out``."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"--rendezvous" in cmd and str(out).encode() in cmd:
            found.append(pid)
    return found


def test_a_process_that_fails_stops_both_with_its_message(tmp_path):
    """An error in a training process (here: resuming a run that has no checkpoint) reaches the caller as the
    TrainingError that process raised, no process is left running and nothing is written."""
    with pytest.raises(TrainingError, match="has no checkpoint"):
        train(_config(steps=2), tmp_path / "empty", progress=False, processes=2, resume=True)
    assert _workers_left(tmp_path / "empty") == []
    assert not any((tmp_path / "empty").glob("checkpoint-*"))


def test_the_command_line_trains_in_two_processes(tmp_path):
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(_config(steps=2, siit=None).to_dict(), default=str))
    base = [sys.executable, "-m", "vlmbind.organisms", "--config", str(config_path), "--out", str(tmp_path / "run"),
            "--quiet"]
    done = subprocess.run(base + ["--processes", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["step"] == 2
    bad = subprocess.run(base + ["--processes", "4"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "processes must be 1 or 2" in bad.stderr


def test_the_recipe_runner_trains_each_stage_in_the_processes_asked(tmp_path, monkeypatch, capsys):
    """``run_recipe(processes=2)`` (``--processes 2``) passes the count to every stage and records it in the summary
    that shipping turns into the training record's command; a count train() refuses exits 2 with its message."""
    import vlmbind.organisms.recipes as recipes
    from vlmbind.organisms.training.run import TrainResult

    seen = []

    def fake_train(config, out, **kwargs):
        seen.append((kwargs["processes"], kwargs["threads"]))
        checkpoint = Path(out) / f"checkpoint-{config.steps:06d}"
        checkpoint.mkdir(parents=True)
        return TrainResult(out_dir=Path(out), checkpoint=checkpoint, step=config.steps, losses=[], evals=[],
                           wall_time_s=1.0, steps_per_s=1.0)

    monkeypatch.setattr(recipes, "train", fake_train)
    summary = recipes.run_recipe("organism-direct", tmp_path / "run", processes=2, progress=False)
    assert seen == [(2, 1)] * len(recipes.recipe_stages("organism-direct"))
    assert summary["processes"] == 2 and summary["threads"] == 1
    monkeypatch.undo()
    assert recipes.main(["organism-direct", "--out", str(tmp_path / "bad"), "--processes", "3", "--quiet"]) == 2
    assert "processes must be 1 or 2" in capsys.readouterr().err


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_launcher_leaves_a_checkpoint_and_no_training_process(tmp_path, stop):
    """A Ctrl-C (SIGINT) or a SIGTERM reaches the launcher, which passes one interrupt on to rank 0; a SIGKILL passes
    nothing on, and rank 0 sees its parent gone. Either way rank 0 writes a checkpoint at its last finished step (as
    one process does on Ctrl-C) and both training processes are gone soon after."""
    import signal
    import time

    config_path = tmp_path / "run.json"
    config = _config(steps=10_000, siit=None, checkpoint_every=10_000, eval_every=0)
    config_path.write_text(json.dumps(config.to_dict(), default=str))
    # A shell that starts the suite in the background without job control leaves SIGINT ignored, and an ignored
    # signal stays ignored across exec: give the launcher Python's Ctrl-C handler, as a terminal would have it.
    argv = ["vlmbind.organisms", "--config", str(config_path), "--out", str(tmp_path / "run"), "--processes", "2",
            "--quiet"]
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             f"sys.argv = {argv!r}; runpy.run_module('vlmbind.organisms', run_name='__main__', alter_sys=True)")
    launcher = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while len(_workers_left(tmp_path / "run")) < 2 and time.time() < deadline:
            time.sleep(0.5)
        time.sleep(20)  # let them import, build the model and train some steps
        launcher.send_signal(getattr(signal, stop))
        launcher.wait(timeout=300)
        assert launcher.returncode != 0
        deadline = time.time() + 120
        while _workers_left(tmp_path / "run") and time.time() < deadline:
            time.sleep(0.5)
        assert _workers_left(tmp_path / "run") == []
        checkpoints = sorted((tmp_path / "run").glob("checkpoint-*"))
        assert len(checkpoints) == 1, launcher.stderr.read().decode()[-2000:]
        assert 0 < _state(checkpoints[0])["step"] < 10_000
    finally:  # a failed run must not leave training processes behind on the machine
        launcher.kill()
        launcher.wait()
        for pid in _workers_left(tmp_path / "run"):
            os.kill(int(pid), signal.SIGKILL)
