"""Experiment code run from the repository (not installed): ``python recipes/train.py``.

Layering (docs/design.md): recipes import lightning_onebit, never the other way round.
``conf/`` holds the Hydra config tree these modules read.

Imports between the modules form no cycle (``tests/test_recipes.py`` checks it, function-level
imports included):

* the leaves, importing no other recipe module: :mod:`~recipes.common` (shared helpers),
  :mod:`~recipes.shipped` (data and weights inside installed packages);
* :mod:`~recipes.algorithms` (config entry -> optimizer and strategy), :mod:`~recipes.callbacks`,
  :mod:`~recipes.report`;
* the experiments' data and models: :mod:`~recipes.data`, :mod:`~recipes.models`,
  :mod:`~recipes.vision`, :mod:`~recipes.lm`, :mod:`~recipes.nlp` (none imports another, but
  for :mod:`~recipes.lm` reusing :mod:`~recipes.data`'s in-memory datamodule);
* :mod:`~recipes.registry`, the one place that maps config names to datamodules, networks and
  LightningModules (it imports :mod:`~recipes.nlp`, which needs transformers, only when used);
* :mod:`~recipes.runners`, then :mod:`~recipes.train` (the Hydra entry point).
"""
