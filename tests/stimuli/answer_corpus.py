"""Realistic answers of real checkpoints, each with the reading a person would give it (tests/stimuli/test_answers.py).

The prompts are vlmbind's own (``in this image there is a yellow cross , ... and a`` -> ``green pentagon``; ``what
colour is the triangle ? it is`` -> ``purple``; ``is there a green circle ?``; ``how many objects are there ?``). A raw
prompt is continued (the answer starts with a space or a newline); a chat prompt gets a reply. Points are written in
each family's own format on a 200 px canvas with a 4 x 4 grid (cells of 50 px); Qwen2.5-VL's processor resizes 200 px
to 196 px, so its JSON points are in 196 px coordinates. ``cells`` is where the points should land on the canvas
(column, row), or None where the family has no declared frame for the format (the reader must refuse).

Each entry: ``(task, expected answer, output, reading, correct)`` or with a sixth item ``cells``.
"""

from __future__ import annotations

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "llava", "gemma3", "molmo2")
FORMATS = ("raw", "chat")
CANVAS = {"image_size": 200, "grid": 4}
RESIZED = {"qwen2_5_vl": (196, 196)}

CHAT = [
    ("scene", "green pentagon", "Green pentagon.", "green pentagon", True),
    ("scene", "green pentagon", "green pentagon", "green pentagon", True),
    ("scene", "green pentagon", "A green pentagon.", "green pentagon", True),
    ("scene", "green pentagon", "The missing object is a green pentagon.", "green pentagon", True),
    ("scene", "green pentagon", "**Green pentagon**", "green pentagon", True),
    ("scene", "green pentagon", "Green Pentagon", "green pentagon", True),
    ("scene", "green pentagon", "There is a green pentagon in the image.", "green pentagon", True),
    ("scene", "green pentagon", "Green pentagons.", "green pentagon", True),
    ("scene", "green pentagon", "Purple pentagon.", "purple pentagon", False),
    ("scene", "green pentagon", "A green square.", "green square", False),
    ("scene", "green pentagon", "It seems the sentence is incomplete. Could you tell me what you'd like to know?",
     None, False),
    ("scene", "green pentagon", "Green.", None, False),
    ("scene", "green pentagon", "The image shows a yellow cross, a blue star, an orange circle and a green pentagon.",
     "yellow cross", False),
    ("scene", "gray cross", "A grey cross.", "gray cross", True),
    ("query", "purple", "Purple.", "purple", True),
    ("query", "purple", "It is purple.", "purple", True),
    ("query", "purple", "The triangle is purple.", "purple", True),
    ("query", "purple", "The triangle is **purple**.", "purple", True),
    ("query", "purple", "It's purple in colour.", "purple", True),
    ("query", "purple", "Blue.", "blue", False),
    ("query", "gray", "Grey.", "gray", True),
    ("query", "triangle", "Triangle.", "triangle", True),
    ("query", "triangle", "The cyan object is a triangle.", "triangle", True),
    ("query", "triangle", "A circle.", "circle", False),
    ("search", "yes", "Yes.", "yes", True),
    ("search", "yes", "Yes, there is a green circle in the image.", "yes", True),
    ("search", "no", "No, there is no green circle.", "no", True),
    ("search", "yes", "No.", "no", False),
    ("search", "yes", "There is a green circle in the top left corner.", None, False),
    ("count", "4", "4", 4, True),
    ("count", "4", "There are 4 objects.", 4, True),
    ("count", "4", "Four.", 4, True),
    ("count", "4", "There are **four** objects in the image.", 4, True),
    ("count", "4", "There are 4 objects: 1 red circle, 1 blue square, 1 green triangle and 1 yellow star.", 4, True),
    ("count", "4", "I can see 1 red circle, 2 blue squares and 1 star, so 4 in total.", 4, True),
    ("count", "4", "There are a total of 4 objects.", 4, True),
    ("count", "4", "The answer is 4.", 4, True),
    ("count", "4", "There are five objects.", 5, False),
    ("count", "4", "3.", 3, False),
    ("count", "4", "There are several objects.", None, False),
]

RAW = [
    ("scene", "green pentagon", " green pentagon", "green pentagon", True),
    ("scene", "green pentagon", " green pentagon.", "green pentagon", True),
    ("scene", "green pentagon", " green pentagon in the bottom right corner.", "green pentagon", True),
    ("scene", "green pentagon", " green pentagon, all on a white background.", "green pentagon", True),
    ("scene", "green pentagon", " green pentagon. The image is a simple illustration", "green pentagon", True),
    ("scene", "green pentagon", " green pentagon and a red circle", "green pentagon", True),
    ("scene", "green pentagon", " purple pentagon.", "purple pentagon", False),
    ("scene", "green pentagon", " pentagon.", None, False),
    ("scene", "green pentagon", "\ngreen pentagon", "green pentagon", True),
    ("query", "purple", " purple.", "purple", True),
    ("query", "purple", " purple in colour.", "purple", True),
    ("query", "purple", " a purple triangle", "purple", True),
    ("query", "purple", " blue", "blue", False),
    ("query", "triangle", " triangle.", "triangle", True),
    ("query", "triangle", " triangle, and the yellow object is a circle.", "triangle", True),
    ("query", "triangle", " circle.", "circle", False),
    ("search", "yes", "\nYes", "yes", True),
    ("search", "yes", " Yes, there is.", "yes", True),
    ("search", "no", " no", "no", True),
    ("search", "no", "\n\nNo, there isn't.", "no", True),
    ("search", "yes", " There is a green circle.", None, False),
    ("count", "4", " 4", 4, True),
    ("count", "4", " There are 4 objects.", 4, True),
    ("count", "4", " four", 4, True),
    ("count", "4", "\n4 objects", 4, True),
    ("count", "4", " There are five objects in the image.", 5, False),
    ("count", "4", " 4 objects: a red circle, a blue square, a green triangle and a yellow star.", 4, True),
    ("count", "4", " The image has 4 objects in total.", 4, True),
    ("count", "1", " a single object.", 1, True),
    ("count", "0", " none.", 0, True),
]

# cells (column, row) used by the pointing answers below: (0, 1), (2, 3)
_CELLS = [(0, 1), (2, 3)]


def _permille(c: int, r: int) -> tuple[int, int]:
    return 250 * c + 125, 250 * r + 125


def _resized(c: int, r: int) -> tuple[int, int]:
    return round((50 * c + 25) * 196 / 200), round((50 * r + 25) * 196 / 200)


_Q25 = ",\n".join(f'\t{{"point_2d": [{x}, {y}], "label": "object"}}' for x, y in map(lambda p: _resized(*p), _CELLS))
_Q25_BOX = ", ".join(
    f'{{"bbox_2d": [{x - 20}, {y - 20}, {x + 20}, {y + 20}], "label": "green circle"}}'
    for x, y in [_resized(*_CELLS[0])])
_Q2_BOX = "".join(
    f"<|object_ref_start|>object<|object_ref_end|><|box_start|>({x - 100},{y - 100}),({x + 100},{y + 100})"
    f"<|box_end|>" for x, y in map(lambda p: _permille(*p), _CELLS))
_M2 = " ".join(f"{k + 1} {x} {y}" for k, (x, y) in enumerate(map(lambda p: _permille(*p), _CELLS)))

POINTING = {
    "qwen2_5_vl": [
        ("count", "2", f"```json\n[\n{_Q25}\n]\n```\nThere are 2 objects.", 2, True, _CELLS),
        # points and no number: the count is the number of points
        ("count", "2", f"```json\n[\n{_Q25}\n]\n```", 2, True, _CELLS),
        ("count", "2", f"```json\n[\n{_Q25}\n]\n```\nThere are three objects in total.", 3, False, _CELLS),
        ("search", "yes", f"Yes.\n```json\n[{_Q25_BOX}]\n```", "yes", True, _CELLS[:1]),
        ("count", "2", "There are 2 objects, at (25, 74) and (123, 172).", 2, True, None),
    ],
    "qwen2_vl": [
        ("count", "2", f"{_Q2_BOX} There are 2 objects.", 2, True, _CELLS),
        ("count", "2", f"There are two objects: {_Q2_BOX}", 2, True, _CELLS),
        ("search", "yes", f"Yes, {_Q2_BOX[: _Q2_BOX.index('<|box_end|>') + 11]}", "yes", True, _CELLS[:1]),
        ("count", "2", f"{_Q2_BOX}", 2, True, _CELLS),
    ],
    "molmo2": [
        ("count", "2", f'Counting the <points coords="{_M2}">objects</points> shows a total of 2.', 2, True, _CELLS),
        ("count", "2", f'<points coords="1 {_M2}">objects</points> 2', 2, True, _CELLS),
        ("search", "no", "There are none. No.", "no", True, []),
        ("count", "2", f'Counting the <points coords="{_M2}">objects</points> shows a total of 3.', 3, False, _CELLS),
    ],
    "llava": [
        ("count", "2", "There are 2 objects in the image, located at [0.12, 0.38] and (0.62, 0.88).", 2, True, None),
        ("search", "yes", "Yes, there is a green circle at (0.12, 0.38).", "yes", True, None),
        ("count", "2", "There are **2** objects.", 2, True, []),
    ],
    "gemma3": [
        ("count", "2", "There are **2** objects in the image:\n\n*   A red circle\n*   A blue square", 2, True, []),
        ("search", "yes", "Yes, there is a green circle in the image (at about (25, 75)).", "yes", True, None),
        ("count", "2", "Okay, let's count them. There are **two** objects.", 2, True, []),
    ],
}


def entries(family: str, fmt: str) -> list[tuple]:
    """The corpus of one family and prompt format."""
    return [*(CHAT if fmt == "chat" else RAW), *POINTING[family]]
