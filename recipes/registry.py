"""The names the config uses, mapped to what they build: ``data.name`` to a datamodule,
``model.name`` to a network and ``experiment.module`` to a LightningModule.

This is the one module that knows every experiment's data and model modules; they do not import
each other or this registry. :mod:`recipes.nlp` needs transformers and datasets, so it is imported
only when a BERT experiment is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
from omegaconf import DictConfig
from torch import nn

from . import shipped  # noqa: F401  (registers the model_source resolver the BERT configs use)
from .common import plain
from .data import DigitsDataModule
from .lm import LanguageModel, MarkovSource, MarkovTextDataModule
from .models import Classifier, mlp
from .vision import CIFAR10DataModule, resnet18_cifar, vgg16_cifar

__all__ = ["DATAMODULES", "MODULES", "NETWORKS", "build_datamodule", "build_network"]


# -- data.name ---------------------------------------------------------------------------------
def glue(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.nlp.GlueDataModule` (recipes.nlp is imported on use)."""
    from .nlp import GlueDataModule

    return GlueDataModule(**kwargs)


def movie_reviews(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.nlp.MovieReviewsDataModule` (recipes.nlp is imported on use)."""
    from .nlp import MovieReviewsDataModule

    return MovieReviewsDataModule(**kwargs)


def squad(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.nlp.SquadDataModule` (recipes.nlp is imported on use)."""
    from .nlp import SquadDataModule

    return SquadDataModule(**kwargs)


#: data.name -> datamodule class; its constructor takes the rest of the ``data`` config + ``seed``
DATAMODULES: dict[str, Callable[..., L.LightningDataModule]] = {
    "digits": DigitsDataModule, "cifar10": CIFAR10DataModule, "glue": glue, "movie_reviews": movie_reviews,
    "squad": squad,
    "markov": MarkovTextDataModule}


def build_datamodule(data_cfg: Mapping[str, Any], seed: int = 0) -> L.LightningDataModule:
    cfg = dict(data_cfg)
    name = cfg.pop("name")
    if name not in DATAMODULES:
        raise ValueError(f"unknown data.name {name!r}; choose one of {sorted(DATAMODULES)}")
    return DATAMODULES[name](seed=seed, **cfg)


# -- model.name --------------------------------------------------------------------------------
#: model.name -> factory taking the rest of the ``model`` config as keyword arguments
NETWORKS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "resnet18_cifar": resnet18_cifar,
                                                 "vgg16_cifar": vgg16_cifar}


def build_network(model_cfg: Mapping[str, Any]) -> nn.Module:
    cfg = dict(model_cfg)
    name = cfg.pop("name")
    if name not in NETWORKS:
        raise ValueError(f"unknown model.name {name!r}; choose one of {sorted(NETWORKS)}")
    return NETWORKS[name](**cfg)


# -- experiment.module -------------------------------------------------------------------------
def classifier(cfg: DictConfig, alg: dict[str, Any]) -> L.LightningModule:
    return Classifier(build_network(plain(cfg.model)), cfg.model.num_classes, alg,
                      milestones=plain(cfg.optim.milestones), gamma=cfg.optim.gamma)


def bert_glue(cfg: DictConfig, alg: dict[str, Any]) -> L.LightningModule:
    """:func:`recipes.nlp.glue_module` (recipes.nlp is imported on use)."""
    from .nlp import glue_module

    return glue_module(cfg, alg)


def bert_squad(cfg: DictConfig, alg: dict[str, Any]) -> L.LightningModule:
    """:func:`recipes.nlp.squad_module` (recipes.nlp is imported on use)."""
    from .nlp import squad_module

    return squad_module(cfg, alg)


def language_model(cfg: DictConfig, alg: dict[str, Any]) -> L.LightningModule:
    """:class:`recipes.lm.LanguageModel` on the Markov source of ``data`` (its entropy rate is the floor
    of the validation loss)."""
    net = {k: v for k, v in plain(cfg.model).items() if k != "name"}
    source = MarkovSource(cfg.data.vocab, cfg.data.branching, cfg.data.source_seed)
    return LanguageModel(net, alg, source.entropy_rate())


#: experiment.module -> factory (cfg, resolved algorithm entry) -> LightningModule; the
#: lightning runner fits it with the datamodule named by ``data.name``
MODULES: dict[str, Callable[[DictConfig, dict[str, Any]], L.LightningModule]] = {
    "classifier": classifier, "bert_glue": bert_glue, "bert_squad": bert_squad, "lm": language_model}
