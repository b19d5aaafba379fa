"""Strict interchange-intervention training (SIIT): plant a known mechanism at chosen heads of an organism.

A planted mechanism is a high-level causal model plus an alignment. For scene description ("name the missing
object") the high-level model is VSM's pipeline and its variables are named as the conditions that should find them:

* ``id_retrieval``: at a described object's prompt tokens, that object's position (its grid cell);
* ``id_selection``: at the last prompt token, the missing object's position;
* ``feature_retrieval``: at the last prompt token, the missing object's colour and shape.

Interchanging a variable means: run a source input, take the variable's value there, and ask what the high-level
model answers on the base input with that value. The counterfactual scene pairs of :func:`vlmbind.stimuli.scene_pairs`
are built exactly so: their ``answer_counterfactual`` is the high-level answer of the interchange at the pair's patch
positions (the span of one described object, or the last token), and the source gives the variable a value that is
meaningful in the base (a cell holding an object of the base scene, or a colour the base's object can take). So the
high-level model needs no code of its own here: the pairs are its interventions.

An alignment maps each variable to heads (``"layer.head"``: the head's slice of the ``o_proj`` input, where vlmbind's
``hook_z`` reads it). Each step adds to the behaviour loss (the task mixture, as :func:`vlmbind.organisms.train`)

* the IIT loss: for one variable sampled per step, pairs of that condition; the aligned heads' outputs at the pair's
  patch positions are taken from the source run and written into the base run (the engine's ``PatchHeadsWhere``,
  a ``torch.where``, never in place), which is teacher-forced with ``answer_counterfactual`` and must give it;
* the strictness loss: one head outside every alignment, sampled per step, gets the source run's outputs (at every
  prompt position by default, as InterpBench interchanges a whole node), and the base answer must not change.

Changes from InterpBench's recipe (the ``iit`` library's ``StrictIITModelPair``, weights behaviour 1, IIT 1,
strict 0.4, used as the defaults): nodes are attention heads at token positions rather than whole hook points; the
sources are CMA pairs rather than random inputs (a random source would usually give the variable a value with no
meaning in the base); one loss, one optimiser step by default (``single_loss=False`` takes InterpBench's step per
loss); the source run carries no gradient unless ``source_grad``.

The modules, one job each: :mod:`.spec` (:class:`~.spec.SIITSpec`, what to plant, and the table of what each loss
weight needs), :mod:`.pairs` (a step's counterfactual pairs, their rows and their targets), :mod:`.interchange`
(the interchanged and ablated runs, through the engine's hook session), :mod:`.readouts` (the position code and the
linear readouts trained beside the organism), :mod:`.losses` (a step's SIIT losses) and :mod:`.evaluation`
(interchange accuracy, strictness and readout measures on fixed pairs).
"""
