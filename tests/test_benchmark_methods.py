"""The method tables of benchmarks/e2e.py and benchmarks/time_to_accuracy.py (benchmarks/methods.py): every row
resolves to a recipes algorithm entry from which recipes/algorithms.py builds its optimizer and strategy, each
setting in one place, and no two rows of a table build the same method. No fit: building is what a wrong row
breaks."""

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from lightning_onebit import CompressedDDPStrategy, DiLoCo, DiLoCoStrategy
from lightning_onebit.optim import CompressedOptimizer, OnebitAdam, ZeroOneAdam
from lightning_onebit.strategies import BaseDDPStrategy
from lightning_onebit.strategies.ddp_hooks import HookDDPStrategy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import methods  # noqa: E402

from recipes.algorithms import PostLocalSGDStrategy, build_optimizer, build_strategy, load_algorithm  # noqa: E402

W, OVERLAP, LR = 7, 4, 3e-3
TABLES = {"e2e": methods.E2E_METHODS, "tta": methods.TTA_METHODS}


@cache  # each row built once for the tests; a row that fails to build fails its own test
def _built(table: str, method: str):
    alg = methods.algorithm(TABLES[table], method, lr=LR, warmup=W, run={"overlap": OVERLAP})
    p = [torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(4))]
    return alg, build_optimizer(alg, p), methods.strategy(alg)


def _signature(opt, strategy) -> str:
    """What a method runs: its optimizer's class, hyperparameters and settings, and its strategy's."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    extra = {**opt.settings(), **getattr(opt, "schedule_args", {})} if isinstance(opt, CompressedOptimizer) else {}
    if isinstance(opt, DiLoCo):
        extra = {k: getattr(opt, k) for k in ("sync_every", "compression", "overlap", "mixing", "keep_local")}
    own = {k: getattr(strategy, k, None) for k in ("warmup", "hierarchical", "on_nonfinite", "kind", "matrix_rank",
                                                   "start_iter", "_model_averaging_period")}
    return repr((type(opt).__name__, groups, extra, type(strategy).__name__, own))


ROWS = [(t, m) for t, table in TABLES.items() for m in table]


@pytest.mark.parametrize("table,method", ROWS)
def test_every_row_builds_its_optimizer_and_a_strategy_that_sets_none_of_its_settings(table, method):
    alg, opt, strategy = _built(table, method)
    assert alg["lr"] == LR and opt.defaults["lr"] == LR and opt.defaults["weight_decay"] == 0.01
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is True and strategy._start_method == "popen"
    if isinstance(opt, CompressedOptimizer):  # the strategy keeps the optimizer as built and converts nothing
        assert isinstance(strategy, CompressedDDPStrategy) and strategy.optimizer_kwargs == {}
        # the strategy's default policy, but where a row moves the sync into DDP's hook
        assert type(opt) is strategy.optimizer_cls
        assert strategy.on_nonfinite == ("raise" if method.endswith("_hook") else "skip")
        if opt.has_warmup:  # the strategy ends the warm-up, the optimizer does not (warmup_steps=None)
            assert (strategy.warmup, opt.warmup_steps) == (W, None)
    elif isinstance(opt, DiLoCo):
        assert isinstance(strategy, DiLoCoStrategy)
        assert strategy.diloco_kwargs == DiLoCoStrategy().diloco_kwargs  # none of DiLoCo's settings set twice
        assert opt.param_groups[0]["fused"] is True
    else:
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
        assert isinstance(strategy, BaseDDPStrategy)
        assert isinstance(strategy, HookDDPStrategy) == ("comm_hook" in alg)


@pytest.mark.parametrize("table", TABLES)
def test_no_two_rows_of_a_table_build_the_same_method(table):
    signatures = {m: _signature(*_built(table, m)[1:]) for m in TABLES[table]}
    same = [(a, b) for a in signatures for b in signatures if a < b and signatures[a] == signatures[b]]
    assert not same


def test_rows_carry_their_settings_to_the_optimizer_or_the_strategy():
    _, opt, s = _built("e2e", "diloco_4bit")
    assert (opt.sync_every, opt.compression, opt.overlap) == (methods.E2E_DILOCO_H, "4bit", 0)
    _, opt, s = _built("tta", "diloco_4bit_overlap")
    assert (opt.sync_every, opt.compression, opt.overlap, opt.keep_local) == (16, "4bit", OVERLAP, True)
    _, opt, s = _built("tta", "diloco_streaming")
    assert (opt.compression, opt.overlap, opt.mixing, opt.keep_local) == ("fp32", OVERLAP, 0.5, False)
    _, opt, s = _built("e2e", "zero_one_adam")
    assert isinstance(opt, ZeroOneAdam) and s.hierarchical is False
    assert opt.schedule_args == {"var_freeze_step": W, "var_update_scaler": 2, "local_step_scaler": 1,
                                 "local_step_clipper": 4}
    _, opt, s = _built("tta", "zero_one_adam_u8warm")
    assert opt.warmup_comm_dtype == torch.uint8 and s.hierarchical is None
    assert opt.schedule_args == {"var_freeze_step": W, "var_update_scaler": 16, "local_step_scaler": 32678,
                                 "local_step_clipper": 16}
    _, opt, s = _built("tta", "onebit_adam_bf16warm")
    assert type(opt) is OnebitAdam and opt.warmup_comm_dtype == torch.bfloat16 and opt.defaults["fused"] is True
    for hier, flat in methods.E2E_TWO_LEVEL.items():
        assert (_built("e2e", hier)[2].hierarchical, _built("e2e", flat)[2].hierarchical) == (True, False)
    _, _, s = _built("e2e", "powersgd_r4")
    assert (s.kind, s.matrix_rank, s.start_iter) == ("powersgd", 4, W)
    for period in (8, 32):
        _, _, s = _built("tta", f"postlocal_{period}")
        assert isinstance(s, PostLocalSGDStrategy) and (s._model_averaging_period, s.start_iter) == (period, W)


def test_load_algorithm_resolves_the_yaml_and_refuses_an_unknown_entry():
    alg = load_algorithm("onebit_adam", {"lr": 0.5}, {"warmup_comm_dtype": "bf16", "block_size": "${optim.warmup}"})
    assert (alg["lr"], alg["warmup"], alg["block_size"], alg["warmup_comm_dtype"]) == (0.5, 0.15, 0.15, "bf16")
    with pytest.raises(ValueError, match="no algorithm entry 'onebit_adamw'.*'onebit_adam'"):
        load_algorithm("onebit_adamw")
    with pytest.raises(ValueError, match="period .* must be an int >= 1, got 0"):
        build_strategy({**load_algorithm("adam"), "comm_hook": "post_local_sgd", "post_local_period": 0,
                        "post_local_start_iter": 5})
