"""Security: nothing is ever unpickled (statically: no pickle-capable loader in the code; at run time: a whole
load / capture / locate / probe / export round trip with every unpickler disabled), ``trust_remote_code`` is never
switched on by vlmbind, and a run opens no network connection beyond the loopback interface. The UI's loopback
default, its upload checks and the export path checks are tested in test_ui.py and test_export.py."""

from __future__ import annotations

import ast
import io
import pickle
import socket
from pathlib import Path

import pytest
import torch
from helpers import shared_organism

import vlmbind as vb

ROOT = Path(__file__).resolve().parents[2]
CODE = sorted(p for d in ("vlmbind", "benchmarks", "circuits") for p in (ROOT / d).rglob("*.py"))
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal"}
PICKLING_CALLS = {"read_pickle", "to_pickle", "load_pickle"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
            yield node, owner, name


def test_no_pickle_capable_loader_in_the_code():
    assert len(CODE) > 40
    problems = []
    for path in CODE:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{path}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
                problems.append(f"{path}: from {node.module} import")
        for node, owner, name in _calls(tree):
            kwargs = {k.arg: k.value for k in node.keywords}
            if name in PICKLING_CALLS:
                problems.append(f"{path}:{node.lineno}: {name}")
            if owner == "torch" and name == "load":
                safe = kwargs.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    problems.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
            if name == "load" and owner in ("np", "numpy"):
                allow = kwargs.get("allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                    problems.append(f"{path}:{node.lineno}: np.load with allow_pickle")
            remote = kwargs.get("trust_remote_code")
            if isinstance(remote, ast.Constant) and remote.value is True:
                problems.append(f"{path}:{node.lineno}: trust_remote_code=True")
    assert not problems, "\n".join(problems)


def test_the_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    """The static scan is not vacuous: a file with each forbidden pattern is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch, numpy as np\ntorch.load('x')\nnp.load('y', allow_pickle=True)\n"
                   "f(trust_remote_code=True)\nimport pandas as pd\npd.read_pickle('z')\n")
    monkeypatch.setattr(__import__(__name__), "CODE", [bad] * 41)
    with pytest.raises(AssertionError) as err:
        test_no_pickle_capable_loader_in_the_code()
    for needle in ("import pickle", "torch.load", "allow_pickle", "trust_remote_code", "read_pickle"):
        assert needle in str(err.value)


@pytest.fixture
def no_unpickling_no_network(monkeypatch):
    """Every unpickler raises; a socket may connect to loopback only (hub look-ups would fail loudly)."""
    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    class Refusing(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", Refusing)
    monkeypatch.setattr(torch, "load", refuse)
    real_connect = socket.socket.connect
    attempts = []

    def loopback_only(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("::1", "localhost")) \
                and self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise AssertionError(f"network access to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return attempts


def test_a_full_round_trip_unpickles_nothing_and_stays_offline(no_unpickling_no_network, tmp_path):
    import pandas as pd

    from vlmbind.cli import main
    from vlmbind.engine.activations import ActivationSet, capture

    vlm = shared_organism("organism-p2a")  # safetensors from the package
    saved = tmp_path / "saved"
    tiny = vb.load("tiny-qwen2_5_vl")
    tiny.model.save_pretrained(saved)
    tiny.processor.save_pretrained(saved)
    again = vb.load(str(saved), attn_implementation="eager")  # the real from_pretrained path, the same kernel
    batch = again.prepare(vb.stimuli.scene_description(1, 0, n_objects=3)[0].image, "the red object is a")
    torch.testing.assert_close(again.logits(batch), tiny.logits(batch), atol=0, rtol=0)
    data = vb.stimuli.scene_description(4, 0, n_objects=3)
    capture(vlm, data, ["blocks.1.hook_resid_post"], out=tmp_path / "acts", shard_size=2)
    assert len(ActivationSet.load(tmp_path / "acts")) == 4
    assert main(["locate", "--model", "organism-p2a", "--condition", "id_selection", "--n-pairs", "2",
                 "--out", str(tmp_path / "locate")]) == 0
    assert set(pd.read_csv(tmp_path / "locate" / "scores.csv")["n"]) == {2}
    assert main(["export", str(tmp_path / "locate"), "--format", "html"]) == 0
    assert any((tmp_path / "locate" / "export").rglob("*.html"))
    buf = io.BytesIO()
    pickle.dump({"x": 1}, buf)  # the guard itself works
    with pytest.raises(AssertionError, match="unpickle"):
        pickle.loads(buf.getvalue())
    assert no_unpickling_no_network == []
