"""The CIFAR-10 recipes (recipes/vision.py, conf/experiment/*cifar10.yaml): the datamodule on a
tiny CIFAR-10 written in the real on-disk format, the missing-data error, the networks, and
each experiment end to end through recipes/train.py."""

import csv
import io
import json
import math
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

torchvision = pytest.importorskip("torchvision")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `recipes` is run from the repository, not installed

from test_recipes import _compose, _train  # noqa: E402

from recipes.common import DatasetMissingError  # noqa: E402
from recipes.registry import build_datamodule, build_network  # noqa: E402
from recipes.runners import run  # noqa: E402
from recipes.vision import (  # noqa: E402
    CIFAR10_FILES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_URL,
    CIFAR10DataModule,
    SharedImages,
    _unverified_class,
)

PER_BATCH, TEST_SIZE = 16, 32  # images per data_batch_i (5 of them) and in test_batch
LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class _Py2Pickler(pickle._Pickler):
    """Writes ``bytes`` as Python 2 ``str`` (BINSTRING opcodes), as the CIFAR-10 archive's
    cPickle files have them: ``pickle.load(f, encoding="bytes")`` gives ``b"data"`` keys (the
    dataset page's recipe) and ``encoding="latin1"`` gives ``"data"`` (torchvision's reader).
    Python 3's own pickler would write bytes that load as bytes either way."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256
                   else pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def _dump(obj, path: Path) -> None:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    path.write_bytes(buf.getvalue())


def _images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(N, 3072) uint8, channel-major (1024 red, 1024 green, 1024 blue values, rows of 32):
    a class-coloured 16x16 square on a noisy background, so the labels are learnable and the
    channels and rows are told apart."""
    palette = rng.integers(0, 256, size=(10, 3))
    img = rng.integers(0, 64, size=(len(labels), 3, 32, 32))
    for i, y in enumerate(labels):
        top, left = 2 * (y % 5), 8 + (y // 5)  # asymmetric, so a flip shows
        img[i, :, top:top + 16, left:left + 16] = palette[y][:, None, None]
    return img.astype(np.uint8).reshape(len(labels), 3072)


def write_tiny_cifar10(root: Path, seed: int = 0) -> dict[str, tuple[np.ndarray, list[int]]]:
    """``<root>/cifar-10-batches-py`` as the published archive lays it out, with PER_BATCH
    images per training batch and TEST_SIZE in the test batch; returns what was written."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    written = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        n = TEST_SIZE if name == "test_batch" else PER_BATCH
        labels = rng.permutation(np.arange(n) % 10)
        data = _images(labels, rng)
        label = "testing batch 1 of 1" if name == "test_batch" else f"training batch {i + 1} of 5"
        _dump({b"batch_label": label.encode(), b"labels": [int(y) for y in labels], b"data": data,
               b"filenames": [f"{LABEL_NAMES[y]}_s_{i:02d}{j:04d}.png".encode() for j, y in enumerate(labels)]},
              base / name)
        written[name] = (data, [int(y) for y in labels])
    _dump({b"label_names": [n.encode() for n in LABEL_NAMES], b"num_cases_per_batch": PER_BATCH, b"num_vis": 3072},
          base / "batches.meta")
    return written


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("cifar")
    return root, write_tiny_cifar10(root)


def _unnormalise(x: torch.Tensor) -> torch.Tensor:
    """A normalised (3, 32, 32) image back in 0..255."""
    return (x * torch.tensor(CIFAR10_STD)[:, None, None] + torch.tensor(CIFAR10_MEAN)[:, None, None]) * 255


CIFAR_EXPERIMENTS = ("resnet18_cifar10", "vgg16_cifar10", "vgg16_bn_cifar10")


@pytest.mark.parametrize("experiment", CIFAR_EXPERIMENTS)
def test_experiments_hold_the_paper_setting(experiment, monkeypatch):
    """The CD-Adam paper's CIFAR-10 setting, which the trainer presets do not override."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    presets = ((["trainer=cpu"], 2), (["trainer=gpu", "trainer.devices=8"], 8), (["trainer=multinode"], 8))
    for trainer, devices in presets:
        cfg = OmegaConf.to_container(_compose(f"experiment={experiment}", *trainer), resolve=True)
        assert cfg["trainer"]["max_epochs"] == 100 and cfg["trainer"]["devices"] == devices
    assert cfg["experiment"] == {"name": experiment, "runner": "lightning", "compare_baseline": False}
    optim = cfg["optim"]
    assert (optim["lr"], optim["betas"], optim["weight_decay"]) == (1e-4, [0.9, 0.99], 5e-4)
    assert (optim["milestones"], optim["gamma"], optim["warmup"]) == ([50, 75], 0.1, 0.13)
    assert cfg["algorithm"]["warmup"] == 0.13  # 1-bit Adam: 13 of 100 epochs
    assert cfg["data"] == {"name": "cifar10", "root": "data", "download": False, "batch_size": 128, "num_workers": 4,
                           "worker_start_method": "forkserver", "verify": True, "train_subset": None,
                           "val_subset": None}
    assert cfg["model"]["name"] == experiment.split("_")[0] + "_cifar" and cfg["model"]["num_classes"] == 10
    assert cfg["model"].get("batch_norm") == {"vgg16_cifar10": False, "vgg16_bn_cifar10": True}.get(experiment)
    assert (cfg["report"]["primary"], cfg["report"]["goal"]) == ("val_acc", "max")


# -- the datamodule ----------------------------------------------------------------------------
def test_tiny_cifar_is_in_the_published_format(cifar_root):
    root, _ = cifar_root
    base = root / "cifar-10-batches-py"
    assert sorted(p.name for p in base.iterdir()) == sorted(CIFAR10_FILES)
    with open(base / "data_batch_3", "rb") as f:  # the dataset page's reader
        d = pickle.load(f, encoding="bytes")
    assert set(d) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert d[b"data"].dtype == np.uint8 and d[b"data"].shape == (PER_BATCH, 3072)
    assert d[b"batch_label"] == b"training batch 3 of 5" and isinstance(d[b"labels"][0], int)
    with open(base / "batches.meta", "rb") as f:
        meta = pickle.load(f, encoding="latin1")  # torchvision's reader: str keys
    assert meta["label_names"] == LABEL_NAMES and meta["num_vis"] == 3072


def test_datamodule_reads_the_batches_back(cifar_root):
    root, written = cifar_root
    dm = build_datamodule({"name": "cifar10", "root": str(root), "download": False, "batch_size": 8,
                           "num_workers": 0, "verify": False})
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (5 * PER_BATCH, TEST_SIZE)
    # validation = test_batch, in order, only normalised: every pixel comes back exactly
    test_data, test_labels = written["test_batch"]
    for i in (0, 7, TEST_SIZE - 1):
        x, y = dm.val_set[i]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == test_labels[i]
        expected = torch.tensor(test_data[i].reshape(3, 32, 32), dtype=torch.float32)
        torch.testing.assert_close(_unnormalise(x), expected, atol=1e-3, rtol=0)
    # training = data_batch_1..5 in order; every sample is a 4-padded crop, maybe flipped, of its image
    train_labels = [y for b in range(1, 6) for y in written[f"data_batch_{b}"][1]]
    assert [dm.train_set[i][1] for i in range(len(train_labels))] == train_labels
    torch.manual_seed(0)  # the transforms draw from torch's generator
    shifted = flipped = 0
    for i in range(0, 5 * PER_BATCH, 9):
        b, j = divmod(i, PER_BATCH)
        img = torch.tensor(written[f"data_batch_{b + 1}"][0][j].reshape(3, 32, 32), dtype=torch.float32)
        padded = torch.nn.functional.pad(img, (4, 4, 4, 4))
        x = _unnormalise(dm.train_set[i][0])
        crops = [(dy, dx, flip) for dy in range(9) for dx in range(9) for flip in (False, True)
                 if torch.allclose((padded.flip(-1) if flip else padded)[:, dy:dy + 32, dx:dx + 32], x, atol=1e-3)]
        assert crops, f"training sample {i} is no crop/flip of its image"
        shifted += crops[0][:2] != (4, 4)
        flipped += crops[0][2]
    assert shifted >= 6 and 1 <= flipped <= 8  # of 9 samples: random crops and flips, not the identity
    batch_x, batch_y = next(iter(dm.train_dataloader()))
    assert batch_x.shape == (8, 3, 32, 32) and batch_y.dtype == torch.int64


def test_subsets_and_verification(cifar_root):
    root, written = cifar_root
    dm = CIFAR10DataModule(batch_size=4, num_workers=0, root=root, verify=False, train_subset=20, val_subset=6)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (20, 6)
    assert [dm.val_set[i][1] for i in range(6)] == written["test_batch"][1][:6]
    assert len(dm.val_dataloader()) == 2
    assert CIFAR10DataModule(root=root, verify=False).workers == {"num_workers": 4,
                                                                  "multiprocessing_context": "forkserver"}
    again = pickle.loads(pickle.dumps(dm.val_set))  # as DataLoader workers started by spawn receive it
    assert type(again.dataset).__name__ == "UnverifiedCIFAR10" and again[5][1] == written["test_batch"][1][5]
    with pytest.raises(ValueError, match="subset of 200"):
        CIFAR10DataModule(root=root, verify=False, train_subset=200).setup("fit")
    # verify=True (the configs' default) is torchvision's md5 check: generated files fail it
    with pytest.raises(RuntimeError, match="corrupted"):
        CIFAR10DataModule(root=root, num_workers=0).setup("fit")


@pytest.mark.budget(20)  # a fork server that imports torchvision
def test_fork_server_workers_get_the_images_in_shared_memory(cifar_root, monkeypatch):
    """Workers from a fork server (the default) receive the images as a shared-memory handle, not
    a pickled copy per worker and epoch, and load exactly what a loader without workers does."""
    root, _ = cifar_root
    plain = CIFAR10DataModule(batch_size=8, num_workers=0, root=root, verify=False)
    shared = CIFAR10DataModule(batch_size=8, num_workers=2, root=root, verify=False)
    for dm in (plain, shared):
        dm.setup("fit")
    assert isinstance(shared.train_set, SharedImages) and shared.train_set.images.is_shared()
    torch.manual_seed(0)  # the augmentation draws from torch's generator
    a = shared.train_set[3][0]
    torch.manual_seed(0)
    assert torch.equal(a, plain.train_set[3][0])
    for x, y in zip(plain.val_dataloader(), shared.val_dataloader(), strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])

    def no_room(self):
        raise RuntimeError("unable to allocate shared memory: No space left on device")

    monkeypatch.setattr(torch.Tensor, "share_memory_", no_room)  # a container's 64 MB /dev/shm
    with pytest.warns(UserWarning, match="do not fit in shared memory"):
        private = SharedImages(_unverified_class()(str(root), train=False, transform=plain.val_set.transform))
    assert not private.images.is_shared() and torch.equal(private[0][0], plain.val_set[0][0])


def test_missing_data_fails_at_once_with_path_and_remedy(tmp_path):
    cfg = _compose("experiment=resnet18_cifar10", f"data.root={tmp_path / 'nowhere'}")
    with pytest.raises(DatasetMissingError) as e:
        run(cfg, tmp_path / "out")
    msg = str(e.value)
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in msg
    assert CIFAR10_URL in msg and "data.download=true" in msg and "data.root" in msg
    assert not (tmp_path / "out" / "metrics").exists()  # no process started, no step taken
    # an incomplete extraction names the first missing file
    (tmp_path / "partial" / "cifar-10-batches-py").mkdir(parents=True)
    (tmp_path / "partial" / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(DatasetMissingError, match="data_batch_2"):
        CIFAR10DataModule(root=tmp_path / "partial")


def test_missing_torchvision_says_how_to_install(cifar_root, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # what `import torchvision` meets when it is absent
    with pytest.raises(ImportError, match=r"torchvision==0\.29\.1.*pip install -e '\.\[vision\]'"):
        CIFAR10DataModule(root=cifar_root[0])  # in the launching process, before any rank starts
    assert build_network({"name": "vgg16_cifar", "num_classes": 10})  # the networks do not need it


def test_download_happens_in_prepare_data_only(tmp_path, monkeypatch):
    fetched = []

    def fake_download(url, download_root, filename=None, md5=None, **kw):  # no network: write what it would extract
        fetched.append(url)
        write_tiny_cifar10(Path(download_root))

    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", fake_download)
    dm = CIFAR10DataModule(root=tmp_path, download=True, verify=False, num_workers=0)  # missing: no error
    dm.prepare_data()
    dm.prepare_data()  # present now: not fetched again
    dm.setup("fit")  # every rank: reads, never downloads
    assert fetched == [CIFAR10_URL] and len(dm.val_set) == TEST_SIZE


# -- networks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kwargs,params", [
    ("resnet18_cifar", {}, 11_173_962),
    ("vgg16_cifar", {"batch_norm": False}, 14_719_818),
    ("vgg16_cifar", {"batch_norm": True}, 14_728_266),
])
def test_networks(name, kwargs, params):
    net = build_network({"name": name, "num_classes": 10, **kwargs})
    assert sum(p.numel() for p in net.parameters()) == params
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == (
        0 if kwargs.get("batch_norm") is False else (20 if name == "resnet18_cifar" else 13))
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) == (20 if name == "resnet18_cifar" else 13)
    with torch.no_grad():
        assert net.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
        wide = build_network({"name": name, "num_classes": 100, **kwargs}).eval()
        assert wide(torch.randn(1, 3, 32, 32)).shape == (1, 100)


# -- end to end --------------------------------------------------------------------------------
def _short_run(experiment, root, out, *extra, batch_size=4):
    """Two epochs of the experiment on the tiny data (16 training images) with 1-bit Adam,
    2 warm-up steps and the MultiStepLR milestone at epoch 1."""
    return _train([f"experiment={experiment}", "algorithm=onebit_adam", f"data.root={root}", "data.verify=false",
                   "data.num_workers=2", f"data.batch_size={batch_size}", "data.train_subset=16", "data.val_subset=8",
                   "optim.warmup=2", "trainer.max_epochs=2", "optim.milestones=[1]", "trainer.log_every_n_steps=1",
                   f"hydra.run.dir={out}", *extra], cwd=out.parent)


def _check_run(out, experiment, world_size, steps):
    """summary.json's record of the one fit (compare_baseline is off) + the metrics CSV rows."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == experiment and summary["primary"] == "val_acc"
    (r,) = summary["runs"]
    assert r["algorithm"] == "onebit_adam" and r["status"] == "ok", r
    assert (r["world_size"], r["ranks_reported"], r["replicas_identical"]) == (world_size, world_size, True)
    assert r["steps"] == steps and r["switch_step"] == 3 and (r["bytes_sent"] > 0) == (world_size > 1)
    assert 0 <= r["final"]["val_acc"] <= 1
    with open(out / r["metrics_csv"]) as f:
        rows = list(csv.DictReader(f))
    losses = [float(row["train_loss"]) for row in rows if row["train_loss"]]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    val = [row for row in rows if row["val_loss"]]
    assert [int(row["epoch"]) for row in val] == [0, 1]
    return r, val


@pytest.mark.slow
@pytest.mark.budget(150)  # VGG-16 (15M parameters) on 2 ranks through the CLI
def test_vgg16_two_processes_compresses_and_follows_the_lr_schedule(cifar_root, tmp_path):
    """The plain VGG-16 on 2 gloo ranks (the cpu preset). gamma=0 makes the milestone at
    epoch 1 set the lr to 0: the second epoch must leave the (BN-free) network unchanged,
    which holds only if the scheduler drives the compressed optimizer the strategy runs."""
    root, _ = cifar_root
    out = tmp_path / "run"
    proc = _short_run("vgg16_cifar10", root, out, "optim.gamma=0")
    r, val = _check_run(out, "vgg16_cifar10", world_size=2, steps=2 * 2)  # 16 images / 2 ranks / batch 4
    assert r["last_step_ratio_vs_fp32"] > 10  # compressed steps are ~1 bit per value
    assert val[0]["val_loss"] == val[1]["val_loss"] and val[0]["val_acc"] == val[1]["val_acc"]
    assert "compression starts with optimizer step 3" in proc.stdout + proc.stderr and (out / "curves.png").exists()
    assert OmegaConf.to_container(OmegaConf.load(out / "resolved_config.yaml").model) == {
        "name": "vgg16_cifar", "num_classes": 10, "batch_norm": False}


@pytest.mark.slow
@pytest.mark.budget(40)  # a recipe CLI process (torch, Lightning, torchvision, Hydra) and 2 epochs: 18-22 s alone
@pytest.mark.parametrize("experiment", ["resnet18_cifar10", "vgg16_bn_cifar10"])
def test_one_process(cifar_root, tmp_path, experiment):
    """The batch-norm networks on one process (2 processes: above). popen (the gpu preset's
    launcher) with one device starts no process: the rank is the script's own."""
    root, _ = cifar_root
    out = tmp_path / "run"
    _short_run(experiment, root, out, "trainer.devices=1", "trainer.start_method=popen", "report.plot=false",
               batch_size=8)
    _check_run(out, experiment, world_size=1, steps=2 * 2)


@pytest.mark.slow
@pytest.mark.budget(75)  # 3 ResNet-18 CLI runs
def test_resume_with_random_augmentation_matches_the_uninterrupted_run(cifar_root, tmp_path):
    """ResNet-18 with random crops and flips drawn from torch's generator (in the main process:
    num_workers=0): 1 epoch + a resume (ckpt_path=last) to 2 ends with the parameters and metrics of
    2 epochs, because every rank's generators travel with the checkpoint (recipes.callbacks.RNGStates);
    the main-file-only hyperparameters load with weights_only (no OmegaConf objects in them)."""
    root, _ = cifar_root
    common = ["trainer.devices=1", "trainer.start_method=popen", "report.plot=false", "data.num_workers=2",
              "trainer.enable_checkpointing=true"]
    full, part = tmp_path / "full", tmp_path / "part"
    _short_run("resnet18_cifar10", root, full, *common, batch_size=8)
    _short_run("resnet18_cifar10", root, part, *common, "trainer.max_epochs=1", batch_size=8)
    _short_run("resnet18_cifar10", root, part, *common, "ckpt_path=last", batch_size=8)
    a, b = (json.loads((d / "summary.json").read_text())["runs"][0] for d in (full, part))
    assert b["resumed_from"] == str(part / "checkpoints" / "onebit_adam" / "last.ckpt")
    assert (a["param_digest"], a["final"], a["steps"]) == (b["param_digest"], b["final"], b["steps"])
    assert (full / a["metrics_csv"]).read_text() == (part / b["metrics_csv"]).read_text()
