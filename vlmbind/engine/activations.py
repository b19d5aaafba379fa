"""Capture activations once, analyse them many times: :func:`capture` streams chosen sites to safetensors shards and
returns an :class:`ActivationSet` that holds no model.

Design: a run goes through the data in shards of ``shard_size`` examples; each shard is captured batch by batch,
kept only until it is written (``shard-NNNNN.safetensors`` plus ``shard-NNNNN.json`` with its examples' metadata and
token tables, each written atomically), and then the manifest (``manifest.json``, the list of finished shards) is
rewritten atomically. Memory therefore holds at most one shard, whatever the data set's size, and an interrupted run
resumes from the manifest (``resume=True``): a shard is either listed, complete, or ignored and captured again.
Reading is lazy: a site's tensor for one example is read from its shard with ``safe_open`` when asked for.

What is stored per example and site (``tokens``):

* ``"image"``: language-model and projector sites (and DeepStack injections, laid out as the projector's) keep the
  image-token rows (in sequence order), vision-tower sites every token of the tower's output for that example;
* ``"all"``: every sequence position (vision and projector sites as for ``"image"``);
* ``"last"``: the last prompt position only (language-model sites);
* ``"image_mean"``: one row per example and site, the mean (in float32, then stored in ``dtype``) of the rows
  ``"image"`` would keep: all that the pooled probes read, at a token count's fraction of the disk (at FBP's 58,800
  images a 7B-shaped site holds 256 image tokens of width 3,584: about 100 GiB in bfloat16 with ``"image"``, 0.4 GiB
  as means). No row lines up with a token, so nothing can be pooled per object or read per token.

Per example a token table (an int tensor in the shard, :meth:`ActivationSet.token_table`) records, for each stored
language-model token, its sequence position, grid, row, column and the object it covers (``-1``: none; from the
example's objects, :func:`~vlmbind.stimuli.core.object_token_positions`), so analyses can pool per object
(:meth:`ActivationSet.objects`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save_file as save_safetensors
from tqdm.auto import tqdm

from ..core.errors import InputError, NoImageTokensError, close_matches
from ..core.io import atomic_path, write_json_atomic
from ..stimuli.core import object_token_positions

TOKEN_MODES = ("image", "all", "last", "image_mean")
MANIFEST = "manifest.json"
TABLE = "__tokens"
FORMAT = "vlmbind-activations-1"


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def _examples(data: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """``(examples, metadata)`` from a Dataset / list of Examples (metadata from each example's record); a
    sequence that draws its examples on demand (``ColorShapeSplits``) is kept as it is, so no image stays in memory."""
    examples = data if isinstance(data, Sequence) else list(data)
    if not examples:
        raise InputError("capture needs at least one example")
    meta = []
    for i, ex in enumerate(examples):
        if not hasattr(ex, "image") or not hasattr(ex, "prompt"):
            raise InputError(f"item {i} is a {type(ex).__name__}, not an example with an image and a prompt; pass a "
                             "vlmbind.stimuli Dataset or a list of Examples")
        meta.append(ex.to_record() if hasattr(ex, "to_record") else {"prompt": ex.prompt})
    return examples, meta


TABLE_COLUMNS = ("position", "grid", "row", "col", "object")


def _token_table(index: Any, example: Any, tokens: str) -> tuple[np.ndarray, list[str]]:
    """``(T 5 int table, grid names)``: per kept language-model position its position, grid (an index into the
    names, -1 for none), row, col and covered object (-1: none); for a standalone vision encoder, every token of its
    output."""
    if hasattr(index, "token_table"):
        d = index.token_table(getattr(example, "objects", None))
        names = list(dict.fromkeys(d["grid"]))
        grid = [names.index(g) for g in d["grid"]]
        return np.stack([d["position"], grid, d["row"], d["col"], d["object"]], 1).astype(np.int32), names
    if tokens == "last":
        positions = np.array([index.last_position])
    elif tokens == "all":
        positions = np.flatnonzero(index.roles != "pad")
    else:
        positions = np.asarray(index.image_positions)
    seq = len(index.roles)
    grid_of, row_of, col_of = np.full(seq, -1), np.full(seq, -1), np.full(seq, -1)
    names = []
    for g in index.grids:
        rows, cols = g.positions.shape
        rr, cc = np.divmod(np.arange(rows * cols), cols)
        flat = g.positions.ravel()
        fresh = grid_of[flat] == -1  # a position in two grids keeps its first (as TokenIndex.cell does)
        grid_of[flat[fresh]], row_of[flat[fresh]], col_of[flat[fresh]] = len(names), rr[fresh], cc[fresh]
        names.append(g.name)
    owner_of = np.full(seq, -1)
    if getattr(example, "objects", None):
        for k, covered in reversed(list(enumerate(object_token_positions(index, example.objects)))):
            owner_of[np.asarray(covered, dtype=int)] = k  # reversed: the first object covering a token wins
    table = np.stack([positions, grid_of[positions], row_of[positions], col_of[positions], owner_of[positions]], 1)
    return table.astype(np.int32), names


def _kept(rows: torch.Tensor, tokens: str, dtype: torch.dtype) -> torch.Tensor:
    """What a capture stores of one example's ``rows d`` at a site: the rows, or (``image_mean``) their float32
    mean as one row."""
    if tokens == "image_mean":
        rows = rows.float().mean(0, keepdim=True)
    return rows.to(dtype).contiguous()


def _split_rows(value: torch.Tensor, batch: Any) -> list[torch.Tensor]:
    """One ``tokens d`` tensor per example from a vision or projector capture of a whole batch."""
    b = len(batch)
    if value.shape[0] == b and value.ndim >= 3:
        return [v.reshape(-1, value.shape[-1]) for v in value]
    sizes = {img.size for row in batch.images for img in row}
    # rows of the whole batch, whether per image (Qwen's N d) or as one packed sequence (Pixtral's 1 N d)
    flat = value.reshape(-1, value.shape[-1])
    if flat.shape[0] % b or len(sizes) != 1:
        raise InputError("vision and projector captures split per example only for same-size images; capture "
                         "with batch_size=1 when image sizes differ")
    return list(flat.reshape(b, -1, value.shape[-1]))


@dataclass
class ActivationSet:
    """Captured activations on disk (or in memory), read lazily.

    Attributes:
        root: the directory (None for an in-memory set).
        manifest: sites, token mode, model, example count and finished shards.
    """

    root: Path | None
    manifest: dict[str, Any]
    _memory: dict[str, torch.Tensor] | None = None
    _meta: list[dict[str, Any]] | None = None

    # ---- loading --------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, root: str | os.PathLike) -> ActivationSet:
        """Open a captured directory (complete shards only).

        Raises:
            InputError: no manifest, a manifest that is not JSON, or one of another format.
        """
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise InputError(f"{root} holds no {MANIFEST}: not a vlmbind activation set (run vb.capture first)")
        try:
            manifest = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path} is not readable JSON ({exc}); capture again into a fresh directory") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise InputError(f"{path} has format {found!r}, expected {FORMAT!r}")
        return cls(root, manifest)

    # ---- shape of the set -----------------------------------------------------------------------------------------
    @property
    def sites(self) -> list[str]:
        return list(self.manifest["sites"])

    @property
    def tokens_mode(self) -> str:
        return str(self.manifest["tokens"])

    @property
    def complete(self) -> bool:
        return len(self.manifest["shards"]) == self.manifest["n_shards"]

    def __len__(self) -> int:
        return sum(s["n"] for s in self.manifest["shards"])

    def _shard_of(self, i: int) -> tuple[dict[str, Any], int]:
        if not 0 <= i < len(self):
            raise InputError(f"example {i} is out of range: the set holds {len(self)} examples")
        for shard in self.manifest["shards"]:
            if shard["start"] <= i < shard["start"] + shard["n"]:
                return shard, i
        raise InputError(f"example {i} is in no finished shard")

    @property
    def examples(self) -> list[dict[str, Any]]:
        """Each example's metadata (id, task, prompt, answer, objects, fields, grid names), in order."""
        if self._meta is None:
            meta: list[dict[str, Any]] = []
            for shard in self.manifest["shards"]:
                meta += json.loads((self.root / f"{shard['name']}.json").read_text())["examples"]
            self._meta = meta
        return self._meta

    def tensor(self, site: str, i: int) -> torch.Tensor:
        """``tokens d`` activations of example ``i`` at ``site``.

        Raises:
            InputError: an unknown site (with close matches) or example.
        """
        if site not in self.sites:
            raise InputError(f"site {site!r} was not captured; captured: {', '.join(self.sites)}."
                             f"{close_matches(site, self.sites)}")
        key = f"{site}|{i}"
        if self._memory is not None:
            if key not in self._memory:
                raise InputError(f"example {i} is out of range: the set holds {len(self)} examples")
            return self._memory[key]
        shard, _ = self._shard_of(i)
        with safe_open(str(self.root / f"{shard['name']}.safetensors"), framework="pt") as f:
            return f.get_tensor(key)

    def iter_site(self, site: str) -> Iterator[torch.Tensor]:
        """Every example's ``tokens d`` tensor at ``site``, in order, one shard open at a time."""
        if self._memory is not None:
            for i in range(len(self)):
                yield self.tensor(site, i)
            return
        for shard in self.manifest["shards"]:
            with safe_open(str(self.root / f"{shard['name']}.safetensors"), framework="pt") as f:
                for i in range(shard["start"], shard["start"] + shard["n"]):
                    yield f.get_tensor(f"{site}|{i}")

    def pooled(self, site: str, how: str = "mean") -> np.ndarray:
        """``N d`` one vector per example: the mean over its stored tokens, or the last one."""
        if how not in ("mean", "last"):
            raise InputError(f"pooling must be 'mean' or 'last', got {how!r}")
        rows = [(t.float().mean(0) if how == "mean" else t[-1].float()).numpy() for t in self.iter_site(site)]
        return np.stack(rows)

    def stacked(self, site: str) -> tuple[np.ndarray, np.ndarray]:
        """``(N T d tokens, N T mask)``: every example's stored tokens, zero-padded to the longest.

        Raises:
            InputError: a capture of token means (``tokens='image_mean'``), which holds no tokens.
        """
        self._refuse_means("spatial tokens")
        rows = [t.float().numpy() for t in self.iter_site(site)]
        longest = max(len(r) for r in rows)
        out = np.zeros((len(rows), longest, rows[0].shape[-1]), dtype=np.float32)
        mask = np.zeros((len(rows), longest), dtype=bool)
        for i, r in enumerate(rows):
            out[i, : len(r)], mask[i, : len(r)] = r, True
        return out, mask

    def token_table(self, i: int) -> dict[str, np.ndarray]:
        """Example ``i``'s stored tokens: ``position``, ``grid`` (name, '' for none), ``row``, ``col`` and the
        ``object`` each covers (-1: none), one entry per row of its aligned sites."""
        key = f"{TABLE}|{i}"
        if self._memory is not None:
            table = self._memory[key].numpy()
        else:
            shard, _ = self._shard_of(i)
            with safe_open(str(self.root / f"{shard['name']}.safetensors"), framework="pt") as f:
                table = f.get_tensor(key).numpy()
        names = self.examples[i].get("grids", [])
        out = {c: table[:, k] for k, c in enumerate(TABLE_COLUMNS)}
        out["grid"] = np.array([names[g] if g >= 0 else "" for g in table[:, 1]])
        return out

    def per_token(self, site: str, i: int) -> torch.Tensor:
        """Example ``i`` at ``site`` with one row per row of its token table: an aligned site as stored, a
        vision-block site of a family that declares which image token each of its rows is merged into
        (``ModelAdapter.vision_row_tokens``) as the mean of those rows per image token.

        Raises:
            InputError: a site whose rows cannot be lined up with the token table.
        """
        self._refuse_means("per-token rows")
        if self._token_aligned(site):
            return self.tensor(site, i)
        rows_to_tokens = self.manifest.get("vision_row_tokens", {}).get(self.examples[i].get("vision_rows"))
        if not site.startswith("vision.") or rows_to_tokens is None or self.manifest.get("tokens") != "image":
            raise InputError(f"{site}: its rows are not the language model's image tokens in order and the family "
                             "declares no map from them to image tokens; use an LM site, an in-order projector, or "
                             "capture with tokens='image' on a family with ModelAdapter.vision_row_tokens")
        x = self.tensor(site, i).float()
        owner = torch.as_tensor(rows_to_tokens, dtype=torch.long)
        if len(owner) != x.shape[0]:
            raise InputError(f"{site}: example {i} has {x.shape[0]} rows but its map covers {len(owner)}")
        n_tokens = len(self.token_objects(i))
        if int(owner.max()) + 1 != n_tokens:
            raise InputError(f"{site}: example {i}'s rows map to {int(owner.max()) + 1} image tokens, its token "
                             f"table has {n_tokens}")
        sums = torch.zeros(n_tokens, x.shape[1]).index_add_(0, owner, x)
        return sums / torch.bincount(owner, minlength=n_tokens).unsqueeze(1)

    def stacked_per_token(self, site: str) -> np.ndarray:
        """``N T d``: :meth:`per_token` of every example (each example's token table has ``T`` rows)."""
        rows = [self.per_token(site, i).float().numpy() for i in range(len(self))]
        if len({len(r) for r in rows}) != 1:
            raise InputError(f"{site}: examples have different numbers of image tokens; use same-size images")
        return np.stack(rows)

    def token_objects(self, i: int) -> np.ndarray:
        """The object each stored token of example ``i`` covers (-1: none)."""
        return self.token_table(i)["object"]

    def objects(self, site: str) -> tuple[Any, np.ndarray]:
        """Object representations: the mean of the tokens each object covers.

        Returns:
            ``(frame, X)``: one row per (example, object) with example index, object index, colour, shape, row, col;
            ``X`` the ``n_objects d`` means. Objects covering no stored token are left out.

        Raises:
            InputError: a site whose rows are not the language model's image tokens in order.
        """
        self._refuse_means("per-object means")
        if not self._token_aligned(site):
            raise InputError(f"{site}: its rows are not the language model's image tokens in order, so they cannot be "
                             "pooled per object (use an LM site, the projector of a family that keeps the order, or "
                             "a standalone vision encoder's layers)")
        rows, vectors = [], []
        for i, (meta, tensor) in enumerate(zip(self.examples, self.iter_site(site))):
            owner = self.token_objects(i)
            if len(owner) != tensor.shape[0]:
                raise InputError(f"{site}: example {i} has {tensor.shape[0]} rows for {len(owner)} tokens")
            for k, obj in enumerate(meta.get("objects", [])):
                mine = owner == k
                if mine.any():
                    vectors.append(tensor[torch.as_tensor(mine)].float().mean(0).numpy())
                    rows.append({"example": i, "object": k, "colour": obj.get("colour"), "shape": obj.get("shape"),
                                 "row": obj.get("row"), "col": obj.get("col")})
        if not vectors:
            raise InputError(f"{site}: no example has objects covering stored tokens")
        return pd.DataFrame(rows), np.stack(vectors)

    def _refuse_means(self, what: str) -> None:
        if self.manifest.get("tokens") == "image_mean":
            raise InputError(f"this capture keeps one mean row per example and site (tokens='image_mean'), so it has "
                             f"no {what}; capture again with tokens='image'")

    def _token_aligned(self, site: str) -> bool:
        return site in self.manifest.get("aligned_sites", [])


def capture(
    vlm: Any,
    data: Any,
    sites: str | Sequence[str],
    *,
    out: str | os.PathLike | None = None,
    tokens: str = "image",
    batch_size: int = 8,
    shard_size: int = 64,
    resume: bool = False,
    overwrite: bool = False,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    shards: range | None = None,
    manifest_name: str = MANIFEST,
) -> ActivationSet:
    """Run ``data`` through ``vlm`` and keep ``sites`` (wildcards allowed; LM, vision tower and projector).

    Args:
        vlm: a loaded VLM.
        data: a :class:`~vlmbind.stimuli.Dataset` or list of Examples (metadata is kept).
        sites: site names or patterns, e.g. ``"blocks.*.hook_resid_post"``.
        out: directory to stream shards to; None keeps everything in memory (small sets only).
        tokens: ``image``, ``all`` or ``last`` (see the module docstring).
        batch_size: examples per forward.
        shard_size: examples per shard (memory holds at most one shard).
        resume: continue an interrupted run in ``out`` (same sites, tokens, model and data size).
        overwrite: replace a capture already in ``out`` (its manifest and shards; other files stay).
        dtype: storage dtype.
        progress: show a progress bar.
        shards: capture only these shard indices of the whole set (one rank of a data-parallel capture,
            :func:`vlmbind.engine.parallel.capture`); their files carry the whole set's names and example indices.
        manifest_name: the file (relative to ``out``) that records progress; a rank keeps its own.

    Raises:
        InputError: bad arguments, an ``out`` holding another run (without ``resume``), or a resume that does not
            match.
    """
    if tokens not in TOKEN_MODES:
        raise InputError(f"tokens must be one of {TOKEN_MODES}, got {tokens!r}")
    encoder = vlm.n_layers == 0
    if encoder and tokens == "last":
        raise InputError("a vision encoder has no last prompt token; use tokens='image' (every token of its output)")
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive int, got {value!r}")
    resolved = [s.name for s in vlm.sites(sites)]
    if not resolved:
        raise InputError(f"no site matches {sites!r}")
    lm_sites = [s for s in resolved if s.startswith("blocks.")]
    if tokens in ("image", "image_mean") and lm_sites and not getattr(vlm.adapter, "image_tokens_in_sequence", True):
        raise NoImageTokensError(
            f"tokens={tokens!r}: no position of this {vlm.adapter.display_name} model's sequence holds image features "
            f"(the image enters through cross-attention layers), so {lm_sites[:2]}{' ...' if len(lm_sites) > 2 else ''} "
            "have no image-token rows; capture them with tokens='last' or 'all', or capture the projector / vision "
            "sites alone")
    patterns = [s for s in resolved if s.endswith("hook_pattern")]
    if patterns:  # query x key maps over the padded batch, not one vector per token
        raise InputError(f"capture stores one vector per token; {patterns[:3]}{' ...' if len(patterns) > 3 else ''} "
                         "are attention patterns: read them with vlm.run(batch, sites=...) or vlmbind track, and "
                         "leave them out of the capture's sites (e.g. 'blocks.*.hook_resid_post' instead of '*')")
    examples, meta = _examples(data)
    n_shards = (len(examples) + shard_size - 1) // shard_size
    manifest: dict[str, Any] = {
        "format": FORMAT, "model": vlm.name, "family": vlm.family, "sites": resolved, "tokens": tokens,
        "n": len(examples), "shard_size": shard_size, "n_shards": n_shards, "shards": [], "dtype": str(dtype),
        "projector_in_sequence_order": bool(vlm.adapter.projector_in_sequence_order),
        "prompt_format": getattr(vlm, "active_prompt_format", None),  # None: a vision encoder, no prompt
        # sites whose rows line up with each example's token table (so they can be pooled per object)
        "aligned_sites": [] if tokens == "image_mean" else
        [s for s in resolved if encoder or s.startswith("blocks.")
         or (s.startswith(("projector.", "deepstack.")) and vlm.adapter.projector_in_sequence_order)],
    }
    memory: dict[str, torch.Tensor] | None = None
    root = None
    if out is None:
        memory = {}
    else:
        root = Path(out)
        if overwrite and resume:
            raise InputError("overwrite=True and resume=True contradict each other: resume continues the capture "
                             "on disk, overwrite replaces it")
        if overwrite and (root / manifest_name).is_file():
            for stale in [root / manifest_name, *root.glob("shard-*.safetensors"), *root.glob("shard-*.json")]:
                stale.unlink()  # only the capture's own files: anything else in the directory stays
        if (root / manifest_name).is_file():
            old = json.loads((root / manifest_name).read_text())
            if not resume:
                raise InputError(f"{root} already holds a capture; pass resume=True (--resume) to continue it, "
                                 "overwrite=True to replace it, or choose another directory")
            keys = ("format", "model", "sites", "tokens", "n", "shard_size", "prompt_format")
            old.setdefault("prompt_format", manifest["prompt_format"])  # written before formats were recorded
            diff = [k for k in keys if old.get(k) != manifest[k]]
            if diff:
                raise InputError(f"cannot resume {root}: {', '.join(diff)} differ from the run on disk")
            manifest["shards"] = old["shards"]
            if "vision_row_tokens" in old:
                manifest["vision_row_tokens"] = old["vision_row_tokens"]
        elif root.exists() and not root.is_dir():
            raise InputError(f"{root} is a file; pass a directory")
    done = {s["name"] for s in manifest["shards"]}
    lm_sites = [s for s in resolved if s.startswith("blocks.")]
    vision_sites = [] if encoder else [s for s in resolved if s.startswith("vision.")]
    bar = tqdm(total=len(examples), desc="capture", disable=not progress)
    for shard in range(n_shards):
        start = shard * shard_size
        stop = min(start + shard_size, len(examples))
        if _shard_name(shard) in done or (shards is not None and shard not in shards):
            bar.update(stop - start)
            continue
        tensors: dict[str, torch.Tensor] = {}
        shard_meta = []
        for b0 in range(start, stop, batch_size):
            chunk = examples[b0 : min(b0 + batch_size, stop)]
            batch = vlm.prepare([ex.image for ex in chunk], [ex.prompt for ex in chunk])
            # the captured sites are all a capture keeps: logits at one position only (a real vocabulary's logits
            # over the whole sequence cost more than the capture)
            keep = {} if encoder else {"logits_at": [batch.seq_len - 1]}
            cache = vlm.run(batch, sites=resolved, **keep).cache
            first_image = np.cumsum([0] + [len(row) for row in batch.images])
            for r, ex in enumerate(chunk):
                table, grid_names = _token_table(batch.index[r], ex, tokens)
                shard_meta.append({**meta[b0 + r], "index": b0 + r, "grids": grid_names})
                if vision_sites and len(batch.images[r]) == 1:
                    rows_to_tokens = vlm.adapter.vision_row_tokens(batch.inputs, int(first_image[r]))
                    if rows_to_tokens is not None:
                        # one copy per distinct map in the manifest (it depends on the image's grid only), a key
                        # per example: a per-example list would cost as many ints as vision rows
                        rows_to_tokens = np.asarray(rows_to_tokens, dtype=np.int64)
                        key = hashlib.sha1(rows_to_tokens.tobytes()).hexdigest()[:16]
                        manifest.setdefault("vision_row_tokens", {}).setdefault(key, rows_to_tokens.tolist())
                        shard_meta[-1]["vision_rows"] = key
                tensors[f"{TABLE}|{b0 + r}"] = torch.from_numpy(table)
                for site in lm_sites:
                    tensors[f"{site}|{b0 + r}"] = _kept(cache[site][r, table[:, 0]], tokens, dtype)
            for site in resolved:
                if site in lm_sites:
                    continue
                for r, rows in enumerate(_split_rows(cache[site], batch)):
                    tensors[f"{site}|{b0 + r}"] = _kept(rows, tokens, dtype)
            bar.update(len(chunk))
        if memory is not None:
            memory.update(tensors)
        else:
            name = _shard_name(shard)
            with atomic_path(root / f"{name}.safetensors") as tmp:
                save_safetensors(tensors, str(tmp))
            write_json_atomic({"examples": shard_meta}, root / f"{name}.json", indent=None)
            manifest["shards"].append({"name": name, "start": start, "n": stop - start})
            write_json_atomic(manifest, root / manifest_name)
        if memory is not None:
            manifest["shards"].append({"name": _shard_name(shard), "start": start, "n": stop - start,
                                       "examples": shard_meta})
    bar.close()
    if memory is not None:
        result = ActivationSet(None, manifest, memory)
        result._meta = [m for s in manifest["shards"] for m in s.pop("examples")]
        return result
    return ActivationSet(root, manifest)
