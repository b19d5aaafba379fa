"""Property tests for the small text parsers the command line and the analyses share.

Covered here (the site grammar is property-tested in test_sites.py, point formatting / parsing round trips and
never-raises in test_stimuli_search.py): the head-list parser (``"L.H,L.H"``, ``sites.parse_heads`` and
``edits.check_heads``), the object-count range parser (``"N"`` / ``"LOW-HIGH"``), the CLI's int-argument factory
(``commands.arguments.int_at_least``, through ``cli.main``'s exit code), the alpha list, and the Point-to-Answer answer readers
(``p2a_text`` then ``parse_points`` / ``parse_count`` / ``parse_yes_no``, and garbage giving ``[]`` / ``None``).
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmbind import cli
from vlmbind.analysis.position_ids import check_alphas, check_heads
from vlmbind.app.commands.arguments import int_at_least, parse_range
from vlmbind.core.errors import InputError
from vlmbind.core.sites import parse_heads
from vlmbind.stimuli.points import p2a_text, parse_count, parse_points, parse_yes_no

SETTINGS = settings(max_examples=150, deadline=None)
_head = st.tuples(st.integers(0, 200), st.integers(0, 200))


# ----------------------------------------------------------------------------------------------------------------
# head lists: "L.H,L.H"
# ----------------------------------------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(_head, max_size=12), st.sampled_from([",", ", ", " ,", ",,"]), st.booleans())
def test_head_list_round_trips(heads, sep, trailing):
    text = sep.join(f"{l}.{h}" for l, h in heads) + ("," if trailing else "")
    assert parse_heads(text) == heads
    assert parse_heads(heads) == heads  # pairs pass through unchanged
    assert parse_heads([f"{l}.{h}" for l, h in heads]) == heads


@SETTINGS
@given(st.text(max_size=30))
def test_head_list_never_raises_anything_but_input_error(text):
    try:
        heads = parse_heads(text)
    except InputError as exc:
        assert "LAYER.HEAD" in str(exc)  # the message shows the expected form
        return
    assert all(isinstance(l, int) and isinstance(h, int) for l, h in heads)
    # whatever parsed had exactly one dot per comma-separated item
    assert all(item.count(".") == 1 for item in text.split(",") if item.strip())


@SETTINGS
@given(st.lists(st.text(alphabet="0123456789.-x ", min_size=1, max_size=6), min_size=1, max_size=4))
def test_head_items_without_exactly_one_dot_are_refused(items):
    text = ",".join(items)
    if any(item.strip() and item.count(".") != 1 for item in items):
        with pytest.raises(InputError):
            parse_heads(text)


@SETTINGS
@given(st.lists(_head, min_size=1, max_size=8), st.integers(1, 40), st.integers(1, 40))
def test_check_heads_accepts_exactly_the_distinct_in_range_heads(heads, n_layers, n_heads):
    model = SimpleNamespace(n_layers=n_layers, n_heads=n_heads)
    text = ",".join(f"{l}.{h}" for l, h in heads)
    in_range = all(l < n_layers and h < n_heads for l, h in heads)
    distinct = len(set(heads)) == len(heads)
    if in_range and distinct:
        assert check_heads(model, text) == heads
    else:
        with pytest.raises(InputError, match="do not exist" if not in_range else "more than once"):
            check_heads(model, text)


# ----------------------------------------------------------------------------------------------------------------
# object-count ranges: "N" or "LOW-HIGH"
# ----------------------------------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_range_round_trips_and_refuses_empty_ranges(a, b):
    assert parse_range(str(a)) == a
    if a <= b:
        assert parse_range(f"{a}-{b}") == (a, b)
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="empty"):
            parse_range(f"{a}-{b}")


@SETTINGS
@given(st.text(max_size=20))
def test_range_never_raises_anything_but_argument_type_error(text):
    try:
        value = parse_range(text)
    except argparse.ArgumentTypeError as exc:
        assert repr(text) in str(exc) or "empty" in str(exc)
        return
    assert isinstance(value, int) or (isinstance(value, tuple) and value[0] <= value[1])


# ----------------------------------------------------------------------------------------------------------------
# CLI integer arguments: commands.arguments.int_at_least
# ----------------------------------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(-5, 5), st.integers(-10**9, 10**9))
def test_int_factory_accepts_exactly_the_ints_at_or_above_low(low, value):
    parse = int_at_least(low, "--x 3")
    if value >= low:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"below {low}"):
            parse(str(value))


@SETTINGS
@given(st.text(max_size=12).filter(lambda t: not t.strip().lstrip("+-").replace("_", "").isdigit()))
def test_int_factory_refuses_non_integers_naming_them(text):
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        int_at_least(0, "--seed 0")(text)
    assert repr(text) in str(exc.value) or "below" in str(exc.value)


_INT_FLAGS = [("--seed", 0), ("--pairs", 1), ("--eval-n", 1), ("--probe-n", 1)]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_INT_FLAGS), st.integers(-10**6, 10**6))
def test_demo_int_flags_parse_in_range_and_exit_2_below(flag_low, value):
    flag, low = flag_low
    argv = ["demo", flag, str(value)]
    if value >= low:
        args = cli.build_parser().parse_args(argv)
        assert getattr(args, flag[2:].replace("-", "_")) == value
    else:
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
            assert cli.main([*argv, "--model", "tiny-does-not-exist"]) == 2
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vlmbind: error: argument " + flag)
        assert str(value) in lines[0] and out.getvalue() == ""


# ----------------------------------------------------------------------------------------------------------------
# alpha lists
# ----------------------------------------------------------------------------------------------------------------
_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@SETTINGS
@given(st.lists(_finite, min_size=1, max_size=8))
def test_alphas_round_trip_sorted_with_zero(values):
    text = ",".join(repr(v) for v in values)
    assert check_alphas(text) == sorted({0.0, *values})


@SETTINGS
@given(st.lists(st.one_of(_finite.map(repr), st.sampled_from(["nan", "inf", "-inf", "x", "1e999", "--1"])),
                min_size=1, max_size=6))
def test_alphas_refuse_any_non_finite_or_non_number(items):
    def ok(item: str) -> bool:
        try:
            return math.isfinite(float(item))
        except ValueError:
            return False

    text = ",".join(items)
    if all(ok(i) for i in items):
        assert all(math.isfinite(a) for a in check_alphas(text))
    else:
        with pytest.raises(InputError, match="alpha"):
            check_alphas(text)


# ----------------------------------------------------------------------------------------------------------------
# Point-to-Answer answers: what the trace writes, the readers give back
# ----------------------------------------------------------------------------------------------------------------
_point = st.tuples(st.integers(0, 10**4), st.integers(0, 10**4))


@SETTINGS
@given(st.lists(_point, max_size=10), st.integers(0, 10**9))
def test_count_answer_round_trips(points, count):
    text = p2a_text(points, str(count))
    assert parse_points(text) == [(float(x), float(y)) for x, y in points]
    assert parse_count(text) == count


@SETTINGS
@given(st.lists(_point, max_size=10), st.sampled_from(["yes", "no", "Yes", "NO"]))
def test_yes_no_answer_round_trips(points, answer):
    text = p2a_text(points, answer)
    assert parse_yes_no(text) == answer.lower()
    assert parse_points(text) == [(float(x), float(y)) for x, y in points]
    assert parse_count(text) is None  # coordinates are not a count


@SETTINGS
@given(st.text(alphabet=st.characters(blacklist_categories=("Nd",), blacklist_characters="(<"), max_size=40))
def test_garbage_gives_no_points_and_no_count(text):
    assert parse_points(text) == []
    assert parse_count(text) is None


@SETTINGS
@given(st.text(max_size=40).filter(lambda t: "yes" not in t.casefold() and "no" not in t.casefold()))
def test_text_without_yes_or_no_gives_none(text):
    assert parse_yes_no(text) is None


@SETTINGS
@given(st.one_of(st.none(), st.integers(), st.binary(max_size=10), st.lists(st.integers(), max_size=3)))
def test_readers_return_empty_for_non_text(value):
    assert parse_points(value) == []
    assert parse_count(value) is None and parse_yes_no(value) is None
