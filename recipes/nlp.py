"""BERT fine-tuning recipes: GLUE and SQuAD v1.1 with Hugging Face transformers + datasets.

The 1-bit Adam paper fine-tunes BERT on GLUE and SQuAD after pre-training; these are the
experiments ``bert_glue`` and ``bert_squad`` (``conf/experiment/``). Data follow the rules of
:mod:`recipes.data`: ``data.path`` (a ``DatasetDict`` saved with ``save_to_disk``) wins, else
``<data.root>/glue/<task>`` or ``<data.root>/squad``; with ``data.download=true`` a missing set
is fetched from the Hugging Face Hub once (prepare_data) and saved there; otherwise
:class:`~recipes.common.DatasetMissingError` names the path and the remedy at construction,
before any process is started.

Validation under DDP is exact: :class:`EvalShards` gives every rank whole examples (all the
features of one SQuAD example on one rank), each example once, and the same number of batches
on every rank, padded with rows marked ``keep=0``. Equal batch counts are required because DDP
broadcasts BERT's buffers on every forward, so ranks must make the same number of calls;
Lightning's DistributedSampler gets that by repeating samples, which would count them twice.
Keeping an example's features together makes SQuAD post-processing local to a rank (no
gather of logits); torchmetrics then sums the metric states over the ranks.

This module imports transformers and datasets; :mod:`recipes.registry` imports it only when a
BERT experiment is built.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import BinaryF1Score, MulticlassAccuracy, MulticlassMatthewsCorrCoef
from torchmetrics.regression import PearsonCorrCoef, SpearmanCorrCoef
from torchmetrics.text import SQuAD

from .algorithms import build_optimizer
from .common import StopOnDivergence, loader_workers, optional_import, preload_fork_server, require
from .shipped import build_movie_reviews, model_path, pretrained_source

# the recipes' other experiments do not need them
_MISSING = "the BERT recipes (experiment=bert_glue, bert_squad) need transformers and datasets: pip install -e '.[nlp]'"
datasets = optional_import("datasets", _MISSING)
transformers = optional_import("transformers", _MISSING)

__all__ = ["GLUE_TASKS", "EvalShards", "GlueDataModule", "GlueModule", "GlueTask", "MovieReviewsDataModule",
           "SquadDataModule", "SquadModule",
           "best_spans", "glue_module", "glue_task", "merge_best", "squad_module", "squad_targets"]

GLUE_HUB = "nyu-mll/glue"
SQUAD_HUB = "rajpurkar/squad"
#: what the tokenizer returns and the model takes; the collate pads exactly these
MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")


# -- GLUE tasks --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its text columns (one sentence or a pair), ``num_labels`` (1: regression),
    the metrics logged as ``val_<name>`` and those whose mean is the task's GLUE score
    (``val_score``, the number the GLUE leaderboard reports for it)."""

    name: str
    text_keys: tuple[str, ...]
    num_labels: int
    metrics: tuple[str, ...]
    score: tuple[str, ...]
    validation_split: str = "validation"


GLUE_TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", ("sentence",), 2, ("acc", "mcc"), ("mcc",)),
    GlueTask("sst2", ("sentence",), 2, ("acc",), ("acc",)),
    GlueTask("mrpc", ("sentence1", "sentence2"), 2, ("acc", "f1"), ("acc", "f1")),
    GlueTask("qqp", ("question1", "question2"), 2, ("acc", "f1"), ("acc", "f1")),
    GlueTask("stsb", ("sentence1", "sentence2"), 1, ("pearson", "spearman"), ("pearson", "spearman")),
    GlueTask("mnli", ("premise", "hypothesis"), 3, ("acc",), ("acc",), "validation_matched"),
    GlueTask("qnli", ("question", "sentence"), 2, ("acc",), ("acc",)),
    GlueTask("rte", ("sentence1", "sentence2"), 2, ("acc",), ("acc",)),
    GlueTask("wnli", ("sentence1", "sentence2"), 2, ("acc",), ("acc",)),
)}


def glue_task(name: str) -> GlueTask:
    """The task named ``name`` (case and dashes ignored: ``SST-2`` is ``sst2``)."""
    key = str(name).lower().replace("-", "").replace("_", "")
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; choose one of {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def _glue_metric(name: str, num_labels: int) -> Metric:
    if name == "acc":
        return MulticlassAccuracy(num_classes=num_labels, average="micro")
    if name == "f1":  # GLUE's F1 (MRPC, QQP): of the positive class
        return BinaryF1Score()
    if name == "mcc":
        return MulticlassMatthewsCorrCoef(num_classes=num_labels)
    return {"pearson": PearsonCorrCoef, "spearman": SpearmanCorrCoef}[name]()


# -- data ---------------------------------------------------------------------------------------
class EvalShards(DistributedSampler):
    """Validation order for ``num_replicas`` ranks that keeps groups whole and counts nothing twice.

    ``group_sizes`` are the sizes of consecutive runs of indices that must stay on one rank (the
    features of one SQuAD example; 1 per GLUE row). Rank r gets a contiguous run of whole
    groups (split so that ranks get about the same number of indices), followed by indices
    ``>= len(dataset)`` up to the longest rank's count: :class:`_Keep` serves those as
    ``keep=0`` rows, so every rank runs the same number of batches. Being a
    ``DistributedSampler``, Lightning uses it as is instead of replacing it.
    """

    def __init__(self, dataset: Dataset, group_sizes: Sequence[int], num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        n = sum(group_sizes)
        if n != len(dataset):
            raise ValueError(f"group sizes add up to {n}, the dataset has {len(dataset)} rows")
        bounds = [0] * (num_replicas + 1)  # bounds[r]: first index of rank r
        start = 0
        for size in group_sizes:  # a group goes to the rank whose share its first index falls in
            owner = min(start * num_replicas // max(n, 1), num_replicas - 1)
            bounds[owner + 1] = start + size
            start += size
        for r in range(1, num_replicas + 1):  # ranks that got no group start where the previous one ended
            bounds[r] = max(bounds[r], bounds[r - 1])
        self.own = range(bounds[rank], bounds[rank + 1])
        self.num_samples = max(bounds[r + 1] - bounds[r] for r in range(num_replicas))
        self.total_size = self.num_samples * num_replicas
        self._n = n

    def __iter__(self):
        return iter([*self.own, *range(self._n, self._n + self.num_samples - len(self.own))])

    def __len__(self) -> int:
        return self.num_samples


class _Keep(Dataset):
    """Rows of ``ds`` with ``keep=1``; indices past the end (:class:`EvalShards`' padding) give a
    real row with ``keep=0``, which the metrics skip."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self.ds)
        return {**self.ds[i % n], "keep": int(i < n)}


class _Collate:
    """Dynamic padding: the model inputs are padded to the longest row of the batch (BERT pads on
    the right), ``offset_mapping`` with (-1, -1); every other column is stacked as is."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad = {"input_ids": pad_token_id, "token_type_ids": 0, "attention_mask": 0}

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        batch = {}
        for key in rows[0]:
            if key in self.pad:
                batch[key] = torch.tensor([list(r[key]) + [self.pad[key]] * (width - len(r[key])) for r in rows])
            elif key == "offset_mapping":
                batch[key] = torch.tensor([[list(o) for o in r[key]] + [[-1, -1]] * (width - len(r[key]))
                                           for r in rows])
            else:
                batch[key] = torch.tensor([r[key] for r in rows])
        return batch


class _HFDataModule(L.LightningDataModule):
    """Where a Hugging Face dataset lives, fetching it when allowed, and the data loaders."""

    hub: tuple[str, ...] = ()  # load_dataset arguments
    subdir: str = ""  # under data.root
    shipped = False  # built from an installed package (_fetch): no network, so no data.download needed

    def __init__(self, tokenizer: str, path: str | None = None, root: str | None = "data", download: bool = False,
                 global_batch_size: int = 32, eval_batch_size: int = 64, max_length: int = 128, num_workers: int = 0,
                 seed: int = 0, worker_start_method: str = "forkserver") -> None:
        super().__init__()
        self.tokenizer_name = str(tokenizer)
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.max_length, self.num_workers, self.seed = max_length, num_workers, seed
        self.workers = loader_workers(num_workers, worker_start_method)
        fetch = ", ".join(map(repr, self.hub))
        self.location = Path(path) if path else Path(root or "data") / self.subdir
        self.fetch = bool(not path and (download or self.shipped) and not self.location.exists())
        if path:
            require(self.location, f"data.path must be a DatasetDict saved with save_to_disk, e.g. python -c "
                                   f"\"import datasets; datasets.load_dataset({fetch}).save_to_disk('{path}')\"")
        elif not self.fetch:
            require(self.location, f"Rerun with data.download=true to fetch datasets.load_dataset({fetch}) from "
                                   f"the Hugging Face Hub and save it there, or give a DatasetDict saved with "
                                   f"save_to_disk as data.path=<dir> (data.root={root!r}).")
        self.tokenizer: Any = None
        self.train_set: Any = None
        self.val_set: Any = None  # the validation features
        self.val_groups: list[int] = []  # features per validation example, in order

    def prepare_data(self) -> None:
        # local rank 0 of each node. Saved under a name of this process and renamed, so that an
        # interrupted download or nodes sharing a file system never leave a half-written set.
        if self.fetch and not self.location.exists():
            tmp = self.location.with_name(f"{self.location.name}.part-{socket.gethostname()}-{os.getpid()}")
            self._fetch(tmp)
            try:
                tmp.rename(self.location)
            except OSError:  # another node was first
                shutil.rmtree(tmp, ignore_errors=True)
                if not self.location.exists():
                    raise

    def _fetch(self, dest: Path) -> None:
        datasets.load_dataset(*self.hub).save_to_disk(str(dest))

    def _load(self, splits: Sequence[str]) -> Any:
        dd = datasets.load_from_disk(str(self.location))
        missing = [s for s in splits if not isinstance(dd, datasets.DatasetDict) or s not in dd]
        if missing:
            raise ValueError(f"{self.location} must be a DatasetDict with splits {list(splits)} (save_to_disk of "
                             f"datasets.load_dataset(...)); missing: {missing}")
        return dd

    def _tokenizer(self) -> Any:
        tok = transformers.AutoTokenizer.from_pretrained(model_path(self.tokenizer_name))
        if not tok.is_fast:
            raise ValueError(f"{self.tokenizer_name}: the recipes need a fast (Rust) tokenizer for offset mappings")
        return tok

    def per_process_batch(self) -> int:
        """``global_batch_size`` is the paper's batch over all processes and accumulated batches."""
        t = self.trainer
        n = t.world_size * t.accumulate_grad_batches if t is not None else 1
        if self.global_batch_size % n:
            raise ValueError(f"data.global_batch_size={self.global_batch_size} is not divisible by "
                             f"{n} (processes x accumulate_grad_batches)")
        return self.global_batch_size // n

    def train_dataloader(self) -> DataLoader:
        preload_fork_server(self.workers, (__name__, "datasets"))
        return DataLoader(self.train_set, batch_size=self.per_process_batch(), shuffle=True,
                          collate_fn=_Collate(self.tokenizer.pad_token_id), **self.workers)

    def val_dataloader(self) -> DataLoader:
        t = self.trainer
        sampler = EvalShards(self.val_set, self.val_groups, t.world_size if t else 1, t.global_rank if t else 0)
        preload_fork_server(self.workers, (__name__, "datasets"))
        return DataLoader(_Keep(self.val_set), batch_size=self.eval_batch_size, sampler=sampler,
                          collate_fn=_Collate(self.tokenizer.pad_token_id), **self.workers)


class GlueDataModule(_HFDataModule):
    """A GLUE task (:data:`GLUE_TASKS`) tokenised as BERT takes it: ``[CLS] a [SEP] (b [SEP])``,
    truncated to ``max_length``, padded per batch. Batches hold the model inputs and ``labels``
    (float for STS-B); validation batches also ``keep`` (see :class:`EvalShards`)."""

    def __init__(self, task: str, tokenizer: str, **kwargs: Any) -> None:
        self.task = glue_task(task)
        self.hub, self.subdir = (GLUE_HUB, self.task.name), f"glue/{self.task.name}"
        super().__init__(tokenizer, **kwargs)

    def setup(self, stage: str | None = None) -> None:
        t = self.task
        dd = self._load(["train", t.validation_split])
        self.tokenizer = tok = self._tokenizer()
        regression = t.num_labels == 1

        def encode(rows: dict[str, list]) -> dict[str, list]:
            enc = tok(*(rows[k] for k in t.text_keys), truncation=True, max_length=self.max_length)
            return {**{k: enc[k] for k in MODEL_INPUTS if k in enc},
                    "labels": [float(y) if regression else int(y) for y in rows["label"]]}

        def prepare(split: str) -> Any:
            ds = dd[split]
            absent = [k for k in (*t.text_keys, "label") if k not in ds.column_names]
            if absent:
                raise ValueError(f"{self.location}/{split}: GLUE {t.name} needs columns {[*t.text_keys, 'label']}, "
                                 f"missing {absent}")
            # in memory: ranks tokenise at the same time, and data.path may be read-only
            return ds.map(encode, batched=True, remove_columns=ds.column_names, keep_in_memory=True,
                          load_from_cache_file=False)

        self.train_set, self.val_set = prepare("train"), prepare(t.validation_split)
        self.val_groups = [1] * len(self.val_set)


class MovieReviewsDataModule(GlueDataModule):
    """Rotten Tomatoes sentence polarity, real movie-review snippets (:mod:`recipes.shipped`: where it
    comes from, its licence, the dev split), as GLUE's SST-2 task: built from the installed
    ``movie-reviews`` package into ``<data.root>/movie_reviews`` on first use, with no network."""

    subdir = "movie_reviews"
    shipped = True

    def __init__(self, tokenizer: str, task: str = "sst2", **kwargs: Any) -> None:
        if glue_task(task).name != "sst2":
            raise ValueError(f"data.name=movie_reviews is one-sentence polarity in SST-2's columns: data.task must "
                             f"be sst2, got {task!r}")
        self.task = glue_task("sst2")
        _HFDataModule.__init__(self, tokenizer, **kwargs)  # not GlueDataModule's: no Hub location

    def _fetch(self, dest: Path) -> None:
        build_movie_reviews(dest)


class SquadDataModule(_HFDataModule):
    """SQuAD v1.1 as in Hugging Face's ``run_qa.py``: question + context windows of ``max_length``
    tokens overlapping by ``doc_stride``. Training features carry ``start_positions`` /
    ``end_positions`` (the [CLS] token, 0, when the answer is not inside the window); validation
    features carry ``example_idx`` and ``offset_mapping`` (character spans of context tokens,
    (-1, -1) elsewhere) for :func:`best_spans`. ``val_examples`` are the raw validation rows."""

    hub, subdir = (SQUAD_HUB,), "squad"

    def __init__(self, tokenizer: str, max_length: int = 384, doc_stride: int = 128, **kwargs: Any) -> None:
        super().__init__(tokenizer, max_length=max_length, **kwargs)
        if doc_stride >= max_length:
            raise ValueError(f"data.doc_stride={doc_stride} must be smaller than data.max_length={max_length}")
        self.doc_stride = doc_stride
        self.val_examples: Any = None

    def _windows(self, rows: dict[str, list]) -> Any:
        return self.tokenizer([q.lstrip() for q in rows["question"]], rows["context"], truncation="only_second",
                              max_length=self.max_length, stride=self.doc_stride, return_overflowing_tokens=True,
                              return_offsets_mapping=True)

    def _train_features(self, rows: dict[str, list]) -> dict[str, list]:
        enc = self._windows(rows)
        starts, ends = [], []
        for i, ex in enumerate(enc["overflow_to_sample_mapping"]):
            offsets, seq = enc["offset_mapping"][i], enc.sequence_ids(i)
            answer = rows["answers"][ex]
            a = answer["answer_start"][0]
            b = a + len(answer["text"][0])
            lo = seq.index(1)  # the window's first and last context token
            hi = len(seq) - 1 - seq[::-1].index(1)
            if not (offsets[lo][0] <= a and offsets[hi][1] >= b):
                starts.append(0)  # answer not (entirely) in this window: point at [CLS]
                ends.append(0)
                continue
            start = lo  # the last context token starting at or before a ...
            while start <= hi and offsets[start][0] <= a:
                start += 1
            end = hi  # ... and the first one from it on that ends at or after b
            while end >= start - 1 and offsets[end][1] >= b:
                end -= 1
            starts.append(start - 1)
            ends.append(end + 1)
        return {**{k: enc[k] for k in MODEL_INPUTS if k in enc}, "start_positions": starts, "end_positions": ends}

    def _val_features(self, rows: dict[str, list], indices: list[int]) -> dict[str, list]:
        enc = self._windows(rows)
        sample = enc["overflow_to_sample_mapping"]
        offsets = [[list(o) if s == 1 else [-1, -1] for o, s in zip(enc["offset_mapping"][i], enc.sequence_ids(i),
                                                                    strict=True)]
                   for i in range(len(sample))]
        return {**{k: enc[k] for k in MODEL_INPUTS if k in enc}, "offset_mapping": offsets,
                "example_idx": [indices[ex] for ex in sample]}

    def setup(self, stage: str | None = None) -> None:
        dd = self._load(["train", "validation"])
        for split in ("train", "validation"):
            absent = [k for k in ("id", "context", "question", "answers") if k not in dd[split].column_names]
            if absent:
                raise ValueError(f"{self.location}/{split}: SQuAD needs columns id, context, question, answers; "
                                 f"missing {absent}")
        self.tokenizer = self._tokenizer()
        train, val = dd["train"], dd["validation"]
        self.train_set = train.map(self._train_features, batched=True, remove_columns=train.column_names,
                                   keep_in_memory=True, load_from_cache_file=False)
        self.val_set = val.map(self._val_features, batched=True, with_indices=True, remove_columns=val.column_names,
                               keep_in_memory=True, load_from_cache_file=False)
        self.val_examples = val
        counts = [0] * len(val)
        for ex in self.val_set["example_idx"]:
            counts[ex] += 1
        self.val_groups = counts  # features of one example are consecutive (map keeps the order)


# -- SQuAD post-processing ------------------------------------------------------------------------
def best_spans(start_logits: torch.Tensor, end_logits: torch.Tensor, offsets: torch.Tensor, n_best: int = 20,
               max_answer_length: int = 30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per feature, the best answer span as Hugging Face's SQuAD v1.1 post-processing picks it:
    among the ``n_best`` highest start and end logits, pairs of context tokens with
    ``start <= end < start + max_answer_length``, scored by start + end logit.

    ``offsets`` (B, L, 2) are character spans, (-1, -1) for tokens outside the context and
    padding. Returns (score, start_char, end_char), each (B,); -inf and -1 where no pair is valid.
    """
    k = min(n_best, start_logits.shape[1])
    s_val, s_idx = start_logits.float().topk(k, dim=1)
    e_val, e_idx = end_logits.float().topk(k, dim=1)
    context = offsets[..., 0] >= 0
    length = e_idx[:, None, :] - s_idx[:, :, None] + 1  # (B, k starts, k ends)
    valid = (context.gather(1, s_idx)[:, :, None] & context.gather(1, e_idx)[:, None, :]
             & (length >= 1) & (length <= max_answer_length))
    scores = (s_val[:, :, None] + e_val[:, None, :]).masked_fill(~valid, -math.inf).flatten(1)
    score, best = scores.max(1)
    start_tok = s_idx.gather(1, (best // k)[:, None])
    end_tok = e_idx.gather(1, (best % k)[:, None])
    start_char = offsets[..., 0].gather(1, start_tok).squeeze(1)
    end_char = offsets[..., 1].gather(1, end_tok).squeeze(1)
    none = torch.isinf(score)
    return score, start_char.masked_fill(none, -1), end_char.masked_fill(none, -1)


def merge_best(best: dict[int, tuple[float, int, int]], example_idx: torch.Tensor, score: torch.Tensor,
               start_char: torch.Tensor, end_char: torch.Tensor) -> None:
    """Keep, per example, the best span over its features (an example seen with no valid span
    stays in ``best`` with score -inf and predicts the empty answer)."""
    for ex, s, a, b in zip(example_idx.tolist(), score.tolist(), start_char.tolist(), end_char.tolist(), strict=True):
        if ex not in best or s > best[ex][0]:
            best[ex] = (s, a, b)


def squad_targets(best: Mapping[int, tuple[float, int, int]], examples: Any) -> tuple[list[dict], list[dict]]:
    """(preds, target) for ``torchmetrics.text.SQuAD`` from :func:`merge_best`'s spans."""
    preds, target = [], []
    for ex, (_, a, b) in sorted(best.items()):
        row = examples[ex]
        preds.append({"prediction_text": row["context"][a:b] if a >= 0 else "", "id": row["id"]})
        target.append({"answers": {"text": list(row["answers"]["text"]),
                                   "answer_start": list(row["answers"]["answer_start"])}, "id": row["id"]})
    return preds, target


# -- LightningModules -------------------------------------------------------------------------------
class _FineTune(StopOnDivergence, L.LightningModule):
    """A transformers model (``AutoModelFor<auto_class>``) whose optimizer comes from the algorithm
    entry, with an optional linear warm-up/decay LR schedule (BERT's).

    The model is built in ``configure_model``, on each rank: spawned ranks then load the
    checkpoint from disk instead of receiving it pickled, and DDP broadcasts rank 0's weights
    (the randomly initialised head included). ``pretrained=false`` builds it from the config
    alone (smoke runs, tests).
    """

    auto_class = "AutoModel"

    def __init__(self, name_or_path: str, algorithm: Mapping[str, Any], pretrained: bool = True,
                 schedule: str | None = "linear", lr_warmup: int | float = 0.1, **config_kwargs: Any) -> None:
        super().__init__()
        if schedule not in (None, "constant", "linear"):
            raise ValueError(f"optim.schedule must be linear, constant or null, got {schedule!r}")
        if isinstance(lr_warmup, bool) or not ((isinstance(lr_warmup, int) and lr_warmup >= 0)
                                               or (isinstance(lr_warmup, float) and 0 <= lr_warmup < 1)):
            raise ValueError(f"optim.lr_warmup must be steps (an int >= 0) or a fraction in [0, 1), got {lr_warmup!r}")
        self.name_or_path, self.algorithm, self.pretrained = name_or_path, dict(algorithm), pretrained
        self.schedule, self.lr_warmup, self.config_kwargs = schedule, lr_warmup, config_kwargs
        self.save_hyperparameters({"name_or_path": name_or_path, "algorithm": self.algorithm, "pretrained": pretrained,
                                   "schedule": schedule, "lr_warmup": lr_warmup, **config_kwargs})
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        cls = getattr(transformers, self.auto_class)
        if self.pretrained:
            self.model = cls.from_pretrained(self.name_or_path, **self.config_kwargs)
        else:
            config = transformers.AutoConfig.from_pretrained(self.name_or_path, **self.config_kwargs)
            self.model = cls.from_config(config)
        # from_pretrained returns it in eval mode, and Lightning restores the mode a module had
        # before validation: without this, fine-tuning would run without dropout
        self.model.train()

    @staticmethod
    def inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in MODEL_INPUTS if k in batch}

    def configure_optimizers(self) -> Any:
        opt = build_optimizer(self.algorithm, self.parameters())
        if self.schedule in (None, "constant"):
            return opt
        total = int(self.trainer.estimated_stepping_batches)
        warm = self.lr_warmup if isinstance(self.lr_warmup, int) else round(self.lr_warmup * total)
        sched = transformers.get_linear_schedule_with_warmup(opt, warm, total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class GlueModule(_FineTune):
    """Sequence classification (regression for STS-B) on a GLUE task. Logs ``train_loss`` per
    step and, per epoch and over all ranks, ``val_loss``, ``val_<metric>`` for the task's
    metrics and ``val_score`` (their GLUE mean)."""

    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, task: str, name_or_path: str, algorithm: Mapping[str, Any], **kwargs: Any) -> None:
        t = glue_task(task)
        super().__init__(name_or_path, algorithm, num_labels=t.num_labels, **kwargs)
        self.task = t
        self.val_metrics = torch.nn.ModuleDict({m: _glue_metric(m, t.num_labels) for m in t.metrics})
        self.val_loss = MeanMetric()

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**self.inputs(batch), labels=batch["labels"]).loss
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        logits = self.model(**self.inputs(batch)).logits
        keep = batch["keep"].bool()
        if not keep.any():
            return
        logits, labels = logits[keep], batch["labels"][keep]
        if self.task.num_labels == 1:
            preds = logits.squeeze(-1).float()
            losses = torch.nn.functional.mse_loss(preds, labels.float(), reduction="none")
        else:
            preds = logits.argmax(-1)
            losses = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        self.val_loss.update(losses)
        for m in self.val_metrics.values():
            m.update(preds, labels)

    def on_validation_epoch_end(self) -> None:
        # compute() sums the states over the ranks, so every rank logs the same numbers
        # (sync_dist=True averages equal values; without it Lightning warns on every epoch)
        vals = {f"val_{k}": m.compute().float() for k, m in self.val_metrics.items()}
        vals["val_score"] = torch.stack([vals[f"val_{k}"] for k in self.task.score]).mean()
        vals["val_loss"] = self.val_loss.compute().float()
        self.log_dict(vals, prog_bar=True, sync_dist=True)
        for m in (*self.val_metrics.values(), self.val_loss):
            m.reset()


class SquadModule(_FineTune):
    """Extractive question answering on SQuAD v1.1. Logs ``train_loss`` per step and, per epoch
    over all ranks, ``val_exact_match`` and ``val_f1`` (``torchmetrics.text.SQuAD``, in percent)
    of the answers :func:`best_spans` extracts (the validation data must come from
    :class:`SquadDataModule`, whose :class:`EvalShards` keeps an example's features on one rank)."""

    auto_class = "AutoModelForQuestionAnswering"

    def __init__(self, name_or_path: str, algorithm: Mapping[str, Any], n_best: int = 20, max_answer_length: int = 30,
                 **kwargs: Any) -> None:
        super().__init__(name_or_path, algorithm, **kwargs)
        self.n_best, self.max_answer_length = n_best, max_answer_length
        self.val_squad = SQuAD()
        self._best: dict[int, tuple[float, int, int]] = {}

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**self.inputs(batch), start_positions=batch["start_positions"],
                          end_positions=batch["end_positions"]).loss
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        out = self.model(**self.inputs(batch))
        keep = batch["keep"].bool()
        score, a, b = best_spans(out.start_logits[keep], out.end_logits[keep], batch["offset_mapping"][keep],
                                 self.n_best, self.max_answer_length)
        merge_best(self._best, batch["example_idx"][keep], score, a, b)

    def on_validation_epoch_end(self) -> None:
        preds, target = squad_targets(self._best, self.trainer.datamodule.val_examples)
        self._best = {}
        if preds:
            self.val_squad.update(preds, target)
        res = self.val_squad.compute()  # sums exact/f1/total over the ranks
        self.val_squad.reset()
        self.log_dict({"val_exact_match": res["exact_match"].float(), "val_f1": res["f1"].float()}, prog_bar=True,
                      sync_dist=True)  # equal on every rank already, see GlueModule


# -- factories for recipes.registry.MODULES -----------------------------------------------------------
def _finetune_kwargs(cfg: DictConfig) -> dict[str, Any]:
    source = pretrained_source(cfg.model.name_or_path, cfg.model.get("pretrained_path"))
    return {"name_or_path": source, "pretrained": bool(cfg.model.get("pretrained", True)),
            "schedule": cfg.optim.get("schedule"), "lr_warmup": OmegaConf.select(cfg, "optim.lr_warmup", default=0)}


def glue_module(cfg: DictConfig, alg: dict[str, Any]) -> GlueModule:
    return GlueModule(cfg.data.task, algorithm=alg, **_finetune_kwargs(cfg))


def squad_module(cfg: DictConfig, alg: dict[str, Any]) -> SquadModule:
    return SquadModule(algorithm=alg, n_best=cfg.experiment.get("n_best", 20),
                       max_answer_length=cfg.experiment.get("max_answer_length", 30), **_finetune_kwargs(cfg))
