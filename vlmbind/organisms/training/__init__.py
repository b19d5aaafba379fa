"""The organisms trainer: AdamW on answer tokens over a seeded task mixture, with atomic, resumable checkpoints.

One job per module: :mod:`.config` (:class:`~.config.TrainConfig` and the learning-rate schedule), :mod:`.step` (one
training step: its losses, its optimiser step and the readouts trained beside the organism), :mod:`.evaluation`
(what a run evaluates every ``eval_every`` steps), :mod:`.checkpoints` (writing, reading and resuming checkpoints)
and :mod:`.run` (:func:`~.run.train`, and the run in this process as named steps). The command line is
:mod:`vlmbind.organisms.cli`; the public names are :func:`vlmbind.organisms.train`, ``TrainConfig`` and the rest of
:mod:`vlmbind.organisms`' table.
"""
