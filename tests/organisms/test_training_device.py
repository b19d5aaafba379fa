"""Training on another device than the CPU: the devices a run refuses (here, before any model is built), and on a
GPU the CUDA run equal to the CPU run of the same config (behaviour only, scene SIIT with every readout, pointing
SIIT), resumed on the device from its own checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vlmbind.core.errors import TrainingError
from vlmbind.organisms import TrainConfig, train
from vlmbind.organisms.cli import main as organisms_main
from vlmbind.organisms.training.run import training_device

SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vision_depth": 1, "vision_hidden": 32,
         "vision_heads": 2}


def small_config(**overrides) -> TrainConfig:
    fields = dict(tasks={"scene": 1.0}, task_options={"scene": {"objects": [2, 3]}}, steps=6, batch_size=8,
                  image_size=56, warmup=2, lr=3e-3, checkpoint_every=3, eval_every=6, eval_size=4, model=SMALL)
    return TrainConfig(**{**fields, **overrides})


@pytest.mark.parametrize("device, processes, match", [
    ("cuda:7" if torch.cuda.is_available() else "cuda", 1, "no CUDA device"),
    ("cuda", 2, "two training processes run on the CPU"),
    ("mps", 1, "cpu or cuda, not mps"),
    ("a gpu", 1, "not a torch device name"),
])
def test_devices_a_run_cannot_use_are_refused_by_name(tmp_path, device, processes, match):
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a CUDA device 7")
    with pytest.raises(TrainingError, match=match):
        training_device(device, processes)
    with pytest.raises(TrainingError, match=match):
        train(small_config(), tmp_path / "run", progress=False, device=device, processes=processes)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_the_command_line_refuses_a_missing_device_with_exit_2(tmp_path, capsys):
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a CUDA device 7")
    config = tmp_path / "run.json"
    config.write_text(json.dumps(small_config().to_dict()))
    assert organisms_main(["--config", str(config), "--out", str(tmp_path / "run"), "--device", "cuda:7",
                           "--quiet"]) == 2
    assert "no CUDA device cuda:7" in capsys.readouterr().err


def test_a_cpu_run_records_no_device(tmp_path):
    result = train(small_config(steps=2, checkpoint_every=2, eval_every=0), tmp_path / "run", progress=False,
                   device="cpu")
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert result.step == 2 and "device" not in state


SCENE_SIIT = {"alignments": {"feature_retrieval": ["1.1"], "id_selection": ["1.0", "0.3"], "id_retrieval": ["0.2"]},
              "aggregation_heads": ["0.3"], "pairs": 4, "objects": [3, 3], "position_layer": 0,
              "position_readout": "trained", "selection_weight": 1.0, "selection_attention_weight": 1.0,
              "retrieval_attention_weight": 1.0, "interchanged_selection_weight": 1.0, "source_grad": True,
              "gather_interchange_weight": 1.0, "gather_selection_weight": 1.0, "selecting_interchange_weight": 1.0,
              "retrieval_readout_weight": 1.0, "gather_readout_weight": 1.0, "ablation_strict_weight": 1.0}
CONFIGS = {
    "behaviour": lambda: small_config(tasks={"scene": 1.0, "count": 0.5}, task_options={"count": {"objects": [1, 4]}}),
    "scene_siit": lambda: small_config(
        image_size=112, task_options={"scene": {"objects": [3, 3], "colours": ["red", "green", "blue", "yellow"],
                                                "shapes": ["square", "circle", "triangle"]}},
        attn_implementation="eager", siit=SCENE_SIIT),
    "point_siit": lambda: TrainConfig(
        regime="p2a", tasks={"search": 0.5, "count": 0.5},
        task_options={"search": {"objects": [1, 6]}, "count": {"objects": [1, 4]}}, image_size=168,
        model={**SMALL, "layers": 4}, steps=6, batch_size=8, warmup=2, checkpoint_every=3, eval_every=6, eval_size=4,
        attn_implementation="eager", point_siit={"heads": ["2.3"], "pairs": 6, "strict_head_weights": {"2.0": 4.0},
                                                 "position_layer": 0}),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_cuda_run_is_the_cpu_run(tmp_path, kind):
    """The same config trained on the CPU and on the GPU (stopped at step 3 and resumed there) gives the same
    losses and evaluations up to float error, and the trainer state names the device."""
    config = CONFIGS[kind]()
    cpu = train(config, tmp_path / "cpu", progress=False)
    half = train(config, tmp_path / "cuda", progress=False, device="cuda", until=3)
    gpu = train(config, tmp_path / "cuda", progress=False, device="cuda", resume=True)
    assert half.step == 3 and gpu.step == cpu.step == config.steps
    np.testing.assert_allclose(gpu.losses, cpu.losses, rtol=5e-3, atol=5e-3)
    for a, b in zip(gpu.evals, cpu.evals):
        for task, row in a["tasks"].items():
            assert row["loss"] == pytest.approx(b["tasks"][task]["loss"], rel=5e-3, abs=5e-3), task
    state = json.loads((gpu.checkpoint / "trainer_state.json").read_text())
    assert state["device"] == "cuda"
