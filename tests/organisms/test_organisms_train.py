"""The organisms trainer: fast batches equal the processor's, labels, the seeded mixture, training, resume, init_from,
checkpoints on disk, and LoRA fine-tuning of a tiny model saved to disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import vlmbind as vb
from vlmbind.core.errors import TrainingError
from vlmbind.organisms import (
    BatchBuilder,
    TaskMixture,
    TaskSpec,
    TrainConfig,
    answer_correct,
    answer_loss,
    build_organism,
    canvas_for,
    finetune_lora,
    list_checkpoints,
    load_lora,
    load_weights,
    lr_at,
    train,
)
from vlmbind.organisms.data import IGNORE_INDEX
from vlmbind.stimuli.core import object_token_positions
from vlmbind.stimuli.scenes import scene_description

SMALL = {"layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1, "vision_depth": 1, "vision_hidden": 32,
         "vision_heads": 2}
ALL_TASKS = [TaskSpec(task=t) for t in ("scene", "query", "search", "count")]


def small_config(**overrides) -> TrainConfig:
    base = dict(tasks={"scene": 1.0}, task_options={"scene": {"objects": [2, 3]}}, steps=6, batch_size=8,
                image_size=56, warmup=2, lr=3e-3, checkpoint_every=3, eval_every=0, model=SMALL)
    base.update(overrides)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def organism112():
    return build_organism(seed=0, image_size=112, **SMALL)


def processor_batch(processor, examples):
    texts = ["<|vision_start|><|image_pad|><|vision_end|>" + e.prompt + " " + e.answer + "<|endoftext|>"
             for e in examples]
    return dict(processor(images=[e.image for e in examples], text=texts, return_tensors="pt", padding=True))


# ----------------------------------------------------------------------------------------------------------------
# batches
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("regime", ["direct", "p2a"])
def test_fast_batch_equals_processor_batch(organism112, regime):
    model, processor = organism112
    # every task and variant, plus training rows
    mixture = TaskMixture(ALL_TASKS, regime=regime, image_size=112, seed=3)
    examples = [e for es in mixture.eval_set(1).values() for e in es] + mixture.batch(0, 4)
    fast = BatchBuilder(processor)(examples)
    ref = processor_batch(processor, examples)
    assert set(ref) == set(fast.inputs)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(fast.inputs[key], ref[key]), key
    torch.testing.assert_close(fast.inputs["pixel_values"], ref["pixel_values"], atol=1e-6, rtol=0)
    with torch.no_grad():
        ours = model(**fast.inputs, use_cache=False).logits
        theirs = model(**ref, use_cache=False).logits
        flat = model(**{k: v for k, v in fast.inputs.items() if k != "mm_token_type_ids"}, use_cache=False).logits
    real = fast.inputs["attention_mask"].bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-6, rtol=0)
    # without the type ids Qwen falls back to 1-D positions: the logits move, so the comparison above can fail
    assert (ours[real] - flat[real]).abs().max() > 1e-4


def test_labels_cover_exactly_the_answer_and_eos(organism112):
    _, processor = organism112
    examples = [e for es in TaskMixture(ALL_TASKS, regime="p2a", image_size=112, seed=1).eval_set(1).values()
                for e in es]
    batch = BatchBuilder(processor)(examples)
    tok = processor.tokenizer
    for i, e in enumerate(examples):
        labels, ids, mask = batch.labels[i], batch.inputs["input_ids"][i], batch.inputs["attention_mask"][i]
        on = (labels != IGNORE_INDEX).nonzero().flatten()
        assert on.numel() > 0 and torch.equal(on, torch.arange(on[0], on[-1] + 1))  # one contiguous span
        assert int(on[-1]) == int(mask.sum()) - 1  # ending at the last real token (eos)
        assert torch.equal(labels[on], ids[on])
        assert tok.decode(ids[on]) == " " + e.answer + tok.eos_token
        assert tok.decode(ids[: on[0]]).endswith(e.prompt)
    assert (batch.labels[batch.inputs["attention_mask"] == 0] == IGNORE_INDEX).all()


def test_objects_sit_in_one_image_token_each(organism112):
    model, processor = organism112
    assert canvas_for(168).shape == (6, 6) and canvas_for(112).shape == (4, 4)
    vlm = vb.VLM(model, processor, name="organism", source="test")
    example = TaskMixture([TaskSpec(task="scene", objects=(4, 4))], regime="direct", image_size=112,
                          seed=0).example(0, 0).example
    index = vlm.prepare(example.image, example.prompt).index[0]
    positions = object_token_positions(index, example.objects)
    assert all(len(p) == 1 for p in positions)
    assert len({int(p[0]) for p in positions}) == 4
    for o, p in zip(example.objects, positions):
        assert index.cell(int(p[0]))[2:] == (o.row, o.col)


def test_mixture_is_a_function_of_seed_step_and_row():
    a = TaskMixture(ALL_TASKS, regime="direct", image_size=112, seed=5)
    b = TaskMixture(ALL_TASKS, regime="direct", image_size=112, seed=5)
    small, large = a.batch(7, 3), b.batch(7, 6)
    for x, y in zip(small, large):  # row r does not depend on the batch size
        assert (x.prompt, x.answer) == (y.prompt, y.answer) and x.image.tobytes() == y.image.tobytes()
    other = TaskMixture(ALL_TASKS, regime="direct", image_size=112, seed=6).batch(7, 6)
    assert [e.image.tobytes() for e in other] != [e.image.tobytes() for e in large]
    assert a.batch(8, 6)[0].image.tobytes() != large[0].image.tobytes()
    evals = a.eval_set(4)
    assert set(evals) == {"scene/high", "scene/low", "query/shape", "query/colour", "search/disjunctive",
                          "search/conjunctive", "count/low", "count/high"}
    assert all(e.variant == key.split("/")[1] for key, es in evals.items() for e in es)
    p2a = TaskMixture(ALL_TASKS, regime="p2a", image_size=112, seed=5).batch(7, 6)
    for d, p in zip(large, p2a):  # same draws; only search / count answers change with the regime
        assert d.image.tobytes() == p.image.tobytes()
        assert (d.answer == p.answer) == (d.task in ("scene", "query"))
        if d.task == "count":
            assert p.answer.endswith(" " + d.answer) and p.answer.count("(") == int(d.answer)


def test_weights_choose_the_tasks():
    mix = TaskMixture([TaskSpec(task="scene", weight=3.0), TaskSpec(task="count", weight=1.0)], regime="direct",
                      image_size=168, seed=0)
    tasks = [e.task for e in mix.batch(0, 400)]
    assert 0.68 < tasks.count("scene") / 400 < 0.82


# ----------------------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------------------
def test_config_validation_and_round_trip():
    cfg = small_config(tasks={"count": 1.0, "scene": 2.0}, task_options={"count": {"objects": [1, 4]}})
    assert list(cfg.tasks) == ["scene", "count"]  # canonical order: the draws do not depend on dict order
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(TrainingError, match="regime"):
        small_config(regime="points")
    with pytest.raises(TrainingError, match="scene"):
        small_config(tasks={"scen": 1.0})
    with pytest.raises(TrainingError, match="do not fit"):
        small_config(tasks={"count": 1.0}, task_options={})  # 5-10 objects on a 2x2 grid
    with pytest.raises(TrainingError, match="multiple of 28"):
        small_config(image_size=100)
    with pytest.raises(TrainingError, match="steps"):
        small_config(steps=0)
    with pytest.raises(TrainingError, match="unknown option"):
        small_config(task_options={"scene": {"object": [2, 3]}})
    with pytest.raises(TrainingError, match="warmup"):
        TrainConfig.from_dict({**cfg.to_dict(), "warmpu": 3})


def test_lr_schedule_warms_up_then_decays():
    cfg = small_config(steps=100, warmup=10, lr=1e-3, final_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


# ----------------------------------------------------------------------------------------------------------------
# training, checkpoints, resume, init_from
# ----------------------------------------------------------------------------------------------------------------
def fixed_batch_loss(model, processor, config: TrainConfig) -> float:
    examples = config.mixture().eval_set(16)
    batch = BatchBuilder(processor)([e for es in examples.values() for e in es])
    with torch.no_grad():
        return float(answer_loss(model(**batch.inputs, use_cache=False).logits, batch.labels))


def test_training_reduces_the_loss_on_a_fixed_batch(tmp_path):
    cfg = small_config(steps=25, batch_size=16, warmup=5, checkpoint_every=25)
    model, processor = build_organism(seed=cfg.seed, image_size=cfg.image_size, **SMALL)
    before = fixed_batch_loss(model, processor, cfg)
    result = train(cfg, tmp_path / "run", progress=False)
    load_weights(model, result.checkpoint)
    after = fixed_batch_loss(model, processor, cfg)
    assert after < 0.6 * before, (before, after)
    assert len(result.losses) == 25 and np.mean(result.losses[-5:]) < 0.6 * np.mean(result.losses[:3])
    # the checkpoint is a model directory that vlmbind.load reads, with nothing pickled in it
    files = {p.name for p in result.checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "processor_config.json", "train_config.json",
            "trainer_state.json", "optimizer.safetensors", "optimizer.json"} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle"))]
    vlm = vb.load(result.checkpoint)
    assert vlm.family == "qwen2_5_vl" and vlm.n_layers == 2
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 25 and state["losses"] == result.losses and isinstance(state["rng"]["torch"], list)
    assert TrainConfig.from_dict(state["config"]) == cfg


def test_resume_equals_an_uninterrupted_run(tmp_path):
    cfg = small_config(tasks={"scene": 1.0, "count": 0.5}, task_options={"count": {"objects": [1, 4]}},
                       eval_every=3, eval_size=4, checkpoint_every=2)
    straight = train(cfg, tmp_path / "straight", progress=False)
    half = train(cfg, tmp_path / "resumed", progress=False, until=3)
    assert half.step == 3 and list_checkpoints(tmp_path / "resumed")[-1].name == "checkpoint-000003"
    with pytest.raises(TrainingError, match="resume=True"):
        train(cfg, tmp_path / "resumed", progress=False)
    with pytest.raises(TrainingError, match="lr"):
        train(small_config(tasks=cfg.tasks, task_options=cfg.task_options, eval_every=3, eval_size=4,
                           checkpoint_every=2, lr=1e-2), tmp_path / "resumed", progress=False, resume=True)
    resumed = train(cfg, tmp_path / "resumed", progress=False, resume=True)
    assert resumed.step == straight.step == 6
    assert resumed.losses == straight.losses
    assert resumed.evals == straight.evals
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(straight.checkpoint / name), load_file(resumed.checkpoint / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # keep_checkpoints=2: older ones are pruned, no temporary directories remain
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == ["checkpoint-000004", "checkpoint-000006"]
    with pytest.raises(TrainingError, match="no checkpoint"):
        train(cfg, tmp_path / "empty", progress=False, resume=True)


def test_an_interrupt_writes_a_checkpoint_to_resume_from(tmp_path, monkeypatch):
    cfg = small_config(checkpoint_every=100)
    straight = train(cfg, tmp_path / "straight", progress=False)
    real_batch = TaskMixture.batch

    def interrupted(self, step, batch_size):
        if step == 4:
            raise KeyboardInterrupt
        return real_batch(self, step, batch_size)

    monkeypatch.setattr(TaskMixture, "batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-000004"]
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]  # no temporary leftovers
    monkeypatch.setattr(TaskMixture, "batch", real_batch)
    resumed = train(cfg, tmp_path / "run", progress=False, resume=True)
    assert resumed.losses == straight.losses


def test_init_from_starts_from_the_checkpoint_weights(tmp_path):
    first = train(small_config(steps=3), tmp_path / "first", progress=False)
    cfg = small_config(steps=4, seed=1, init_from=str(first.checkpoint), lr=1e-3)
    second = train(cfg, tmp_path / "second", progress=False, until=1)
    model, processor = build_organism(seed=99, image_size=cfg.image_size, **SMALL)
    load_weights(model, first.checkpoint)
    batch = BatchBuilder(processor)(cfg.mixture().batch(0, cfg.batch_size))
    model.train()
    with torch.no_grad():
        loss = float(answer_loss(model(**batch.inputs, use_cache=False).logits, batch.labels))
    assert loss == pytest.approx(second.losses[0], abs=1e-6)
    fresh = train(small_config(steps=4, seed=1), tmp_path / "fresh", progress=False, until=1)
    assert abs(fresh.losses[0] - second.losses[0]) > 0.1  # the seed-1 init would have given another loss
    bigger = small_config(model={**SMALL, "hidden": 128}, init_from=str(first.checkpoint))
    with pytest.raises(TrainingError, match="do not fit"):
        train(bigger, tmp_path / "bigger", progress=False)


def test_accuracy_helper_matches_greedy_definition():
    logits = torch.full((2, 4, 5), -10.0)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 1], [IGNORE_INDEX, IGNORE_INDEX, 3, 1]])
    logits[:, 1, 3] = 10.0  # predicts 3 after position 1
    logits[0, 2, 1] = 10.0  # row 0 then predicts 1; row 1 predicts 0
    assert answer_correct(logits, labels).tolist() == [True, False]


# ----------------------------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------------------------
def test_lora_finetunes_a_saved_tiny_model(tmp_path):
    base = vb.load("tiny-llava")
    base_dir = tmp_path / "base"
    base.model.save_pretrained(base_dir)
    base.processor.save_pretrained(base_dir)
    vlm = vb.load(base_dir)
    before = {k: v.clone() for k, v in vlm.model.state_dict().items()}
    data = scene_description(8, seed=0, n_objects=2)
    result = finetune_lora(vlm, data, tmp_path / "adapter", steps=12, lr=1e-2, rank=4, batch_size=4, progress=False)
    # a random tiny LLaVA's frozen MLPs and head cap what attention adapters can do: ~1 nat in 12 steps
    assert result.losses[0] - np.mean(result.losses[-3:]) > 0.5, result.losses
    after = vlm.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("language_model.layers" in k and ".self_attn." in k and "lora_" in k for k in saved)
    assert not list((tmp_path / "adapter").glob("*.bin"))
    tuned = load_lora(base_dir, tmp_path / "adapter")
    from vlmbind.organisms.lora import lora_batch

    triples = [(e.image, e.prompt, e.answer) for e in data]
    with torch.no_grad():
        losses = []
        for m in (vlm, tuned):
            batch, labels = lora_batch(m, triples)
            losses.append(float(answer_loss(m.logits(batch), labels)))
    assert losses[0] - losses[1] > 0.5, losses  # the merged adapter carries what was learnt


def test_a_sigterm_to_the_command_line_leaves_a_checkpoint_to_resume_from(tmp_path):
    """A scheduler stops a job with SIGTERM: the one-process run writes a checkpoint at its last finished step, as a
    Ctrl-C does, and the run resumes from it."""
    import signal
    import subprocess
    import sys
    import time

    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(small_config(steps=10_000, checkpoint_every=10_000).to_dict(), default=str))
    proc = subprocess.Popen([sys.executable, "-m", "vlmbind.organisms", "--config", str(config_path), "--out",
                             str(tmp_path / "run"), "--quiet", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(25)  # import, build the model, train some steps
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        assert proc.returncode != 0
        checkpoints = list_checkpoints(tmp_path / "run")
        assert len(checkpoints) == 1, proc.stderr.read().decode()[-2000:]
        assert 0 < json.loads((checkpoints[0] / "trainer_state.json").read_text())["step"] < 10_000
    finally:
        proc.kill()
        proc.wait()
