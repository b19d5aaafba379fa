"""A researcher's own condition and task, outside the package."""

from dataclasses import replace

from vlmbind.stimuli import Counterfactual, Dataset, register_condition, register_task, render, scene_description


@register_condition("shape_swap", task="scene")
def shape_swap(example, rng, context):
    """The unmentioned target takes a shape no object has; patch the last token."""
    target = example.fields["target"]
    objects = list(example.objects)
    used = {o.shape for o in objects}
    options = [s for s in context.shapes if s not in used]
    new = options[int(rng.integers(len(options)))]
    objects[target] = replace(objects[target], shape=new)
    return Counterfactual(image=render(context.canvas, objects), answer=objects[target].name, objects=objects)


def colour_only(example, output):
    words = output.lower().split()
    return words[:1] == example.answer.split()[:1], " ".join(words[:1])


# the colours and shapes of my experiment
COLOURS, SHAPES = ("red", "green", "blue", "yellow"), ("square", "circle", "triangle", "star")


@register_task("scene_colour", score=colour_only)
def scene_colour(n, seed, **options):
    """The scene task in my colours and shapes, scored on the colour word alone (``options``: e.g. the canvas)."""
    data = scene_description(n, seed, colours=COLOURS, shapes=SHAPES, **options)
    return Dataset("scene_colour", [replace(e, task="scene_colour") for e in data], data.params, seed)
