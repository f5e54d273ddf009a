"""Strategy settings: every option checked in the constructor, and an option set on the strategy that the
optimizer ``configure_optimizers`` returned sets otherwise fails at setup naming both values (never one
of them silently dropped). One warm-up resolver for the strategies, PhaseSwitch and the recipes."""

import lightning as L
import pytest
import torch
from lit_models import DigitsMLP

import lightning_onebit  # noqa: F401  (registers the strategy names)
from lightning_onebit import (
    CDAdamStrategy,
    CompressedDDPStrategy,
    DiLoCo,
    DiLoCoStrategy,
    OnebitAdam,
    OnebitAdamStrategy,
    PhaseSwitch,
)
from lightning_onebit.callbacks.phase import check_warmup, resolve_warmup
from lightning_onebit.strategies.ddp_hooks import HookDDPStrategy

pytestmark = pytest.mark.usefixtures("fresh_process_group")


class Configured(DigitsMLP):
    """DigitsMLP whose optimizer gets ``set_nonfinite_policy(*policy)`` and ``set_topology(**topology)``
    from its user before the strategy sees it."""

    def __init__(self, optimizer: str = "OnebitAdam", opt_kwargs: dict | None = None, policy: tuple | None = None,
                 topology: dict | None = None) -> None:
        super().__init__(optimizer=optimizer, opt_kwargs=opt_kwargs)
        self.policy, self.topology = policy, topology

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        if self.policy:
            opt.set_nonfinite_policy(self.policy[0], max_consecutive=self.policy[1])
        if self.topology:
            opt.set_topology(**self.topology)
        return opt


def _trainer(tmp_path, strategy, callbacks=()) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=str(tmp_path), callbacks=list(callbacks))


def _setup_error(tmp_path, strategy, model, callbacks=()) -> str:
    """The message of the ValueError the fit stops with, before any step."""
    trainer = _trainer(tmp_path, strategy, callbacks)
    with pytest.raises(ValueError) as info:
        trainer.fit(model)
    assert trainer.global_step == 0
    return str(info.value)


# -- options set twice ---------------------------------------------------------------------------
DILOCO_CONFLICTS = {  # option: (the strategy's value, the returned DiLoCo's)
    "sync_every": (8, 4), "outer_lr": (0.5, 0.7), "outer_momentum": (0.5, 0.9), "nesterov": (False, True),
    "compression": ("4bit", "fp32"), "fragments": (2, 1), "on_nonfinite": ("skip", "raise"),
    "hierarchical": (False, None), "overlap": (1, 0), "mixing": (0.5, 0.0), "keep_local": (True, False),
    "offload": (True, False),
}


@pytest.mark.parametrize("option", list(DILOCO_CONFLICTS))
def test_a_diloco_option_set_on_the_strategy_and_the_returned_diloco_fails_at_setup(tmp_path, option):
    mine, theirs = DILOCO_CONFLICTS[option]
    msg = _setup_error(tmp_path, DiLoCoStrategy(**{option: mine}),
                       DigitsMLP(optimizer="DiLoCo", opt_kwargs={option: theirs}))
    assert msg == (f"DiLoCoStrategy({option}={mine!r}) but configure_optimizers returned DiLoCo({option}={theirs!r}); "
                   "set it in one place")


# case: (strategy options, the model's configuration, a PhaseSwitch the user adds, what the message names)
CONFLICTS = {
    "optimizer_kwargs": ({"optimizer_kwargs": {"block_size": 16}}, {}, None,
                         ["OnebitAdamStrategy(optimizer_kwargs={'block_size': 16})", "OnebitAdam(block_size=None)"]),
    "optimizer_kwargs-normalised": ({"optimizer_kwargs": {"warmup_comm_dtype": "bf16"}}, {}, None,
                                    ["optimizer_kwargs={'warmup_comm_dtype': 'bf16'}",
                                     "OnebitAdam(warmup_comm_dtype=torch.float32)"]),
    "warmup-steps": ({"warmup": 5}, {"opt_kwargs": {"warmup_steps": 3}}, None,
                     ["OnebitAdamStrategy(warmup=5)", "OnebitAdam(warmup_steps=3)"]),
    "warmup-fraction": ({"warmup": 0.5}, {"opt_kwargs": {"warmup_steps": 3}}, None,  # 0.5 of the 1 step: 1
                        ["OnebitAdamStrategy(warmup=0.5)", "OnebitAdam(warmup_steps=3)"]),
    "warmup-callback": ({"warmup": 5}, {"optimizer": "adamw"}, "auto",
                        ["OnebitAdamStrategy(warmup=5)", "PhaseSwitch(warmup='auto')"]),
    "hierarchical": ({"hierarchical": False}, {"topology": {"hierarchical": True}}, None,
                     ["OnebitAdamStrategy(hierarchical=False)", "OnebitAdam(hierarchical=True by set_topology)"]),
    "on_nonfinite": ({"on_nonfinite": "skip"}, {"policy": ("raise", 10)}, None,
                     ["OnebitAdamStrategy(on_nonfinite='skip')",
                      "OnebitAdam(on_nonfinite='raise' by set_nonfinite_policy)"]),
    "max_consecutive_skips": ({"max_consecutive_skips": 3}, {"policy": ("skip", 5)}, None,
                              ["OnebitAdamStrategy(max_consecutive_skips=3)", "OnebitAdam(max_consecutive_skips=5"]),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_an_option_set_on_the_strategy_and_the_returned_optimizer_fails_at_setup(tmp_path, case):
    options, model, switch, needles = CONFLICTS[case]
    callbacks = [PhaseSwitch(switch)] if switch else []
    msg = _setup_error(tmp_path, OnebitAdamStrategy(**options), Configured(**model), callbacks)
    assert all(n in msg for n in needles) and msg.endswith("set it in one place"), msg


def test_equal_values_pass_and_unset_options_keep_the_optimizers(tmp_path):
    """The same value on both sides is no conflict; an option left unset keeps what the user set on the
    optimizer (its non-finite policy, its topology, its warm-up) instead of the strategy's default."""
    model = Configured(opt_kwargs={"warmup_steps": 3, "block_size": 16, "warmup_comm_dtype": torch.bfloat16},
                       policy=("raise", 4), topology={"hierarchical": False})
    strategy = OnebitAdamStrategy(warmup=3, on_nonfinite="raise", hierarchical=False,
                                  optimizer_kwargs={"block_size": 16, "warmup_comm_dtype": "bf16"})
    trainer = _trainer(tmp_path, strategy)
    trainer.fit(model)
    opt = trainer.optimizers[0]
    assert trainer.global_step == 1 and type(opt) is OnebitAdam
    assert (opt.on_nonfinite, opt.max_consecutive_skips, opt.hierarchical, opt.warmup_steps) == ("raise", 4, False, 3)
    assert not any(isinstance(cb, PhaseSwitch) for cb in trainer.callbacks)  # the optimizer switches itself
    trainer = _trainer(tmp_path, OnebitAdamStrategy())
    trainer.fit(Configured(policy=("raise", 4), topology={"hierarchical": False}))
    opt = trainer.optimizers[0]
    assert (opt.on_nonfinite, opt.max_consecutive_skips, opt.hierarchical) == ("raise", 4, False)
    trainer = _trainer(tmp_path, DiLoCoStrategy(compression="4bit", sync_every=4))
    trainer.fit(DigitsMLP(optimizer="DiLoCo", opt_kwargs={"compression": "4bit", "sync_every": 4}))
    assert (trainer.optimizers[0].compression, trainer.optimizers[0].sync_every) == ("4bit", 4)


def test_a_converted_adamw_takes_the_strategys_options_or_the_defaults(tmp_path):
    strategy = OnebitAdamStrategy(warmup=2, on_nonfinite="raise", max_consecutive_skips=3, hierarchical=False,
                                  optimizer_kwargs={"block_size": 16, "warmup_comm_dtype": "bf16"})
    trainer = _trainer(tmp_path, strategy)
    trainer.fit(DigitsMLP())
    opt = trainer.optimizers[0]
    assert type(opt) is OnebitAdam and opt.defaults["block_size"] == 16 and opt.warmup_comm_dtype == torch.bfloat16
    assert (opt.on_nonfinite, opt.max_consecutive_skips, opt.hierarchical) == ("raise", 3, False)
    (switch,) = [cb for cb in trainer.callbacks if isinstance(cb, PhaseSwitch)]
    assert switch.warmup == 2
    trainer = _trainer(tmp_path, OnebitAdamStrategy())  # nothing set anywhere: the documented defaults
    trainer.fit(DigitsMLP())
    opt = trainer.optimizers[0]
    assert (opt.on_nonfinite, opt.max_consecutive_skips, opt.hierarchical) == ("skip", 10, None)
    (switch,) = [cb for cb in trainer.callbacks if isinstance(cb, PhaseSwitch)]
    assert switch.warmup == 0.15
    trainer = _trainer(tmp_path, DiLoCoStrategy(compression="4bit", outer_lr=0.5))
    trainer.fit(DigitsMLP())
    opt = trainer.optimizers[0]
    assert type(opt) is DiLoCo and (opt.compression, opt.outer_lr, opt.sync_every) == ("4bit", 0.5, 16)


def _fit_in_rank(rank: int, world_size: int, out: str):
    """A Trainer in a rank whose process group exists (as under torchrun: LOCAL_RANK set, so Lightning
    starts no processes): the fit fails at setup, and the rank returns its message."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    trainer = L.Trainer(strategy=DiLoCoStrategy(compression="4bit"), accelerator="cpu", devices=world_size,
                        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=out)
    try:
        trainer.fit(DigitsMLP(optimizer="DiLoCo"))
    except ValueError as exc:
        return trainer.global_rank, trainer.global_step, str(exc)
    return trainer.global_rank, trainer.global_step, None


def test_every_rank_fails_fast_at_setup(tmp_path):
    from dist_utils import run_ranks, values

    got = values(run_ranks(_fit_in_rank, 2, str(tmp_path), timeout_s=60))
    assert [(r, step) for r, step, _ in got] == [(0, 0), (1, 0)]
    for *_, msg in got:
        assert msg and "DiLoCoStrategy(compression='4bit')" in msg and "DiLoCo(compression='fp32')" in msg, msg


# -- options checked in the constructor ----------------------------------------------------------------
BAD_OPTIONS = [
    (OnebitAdamStrategy, {"warmup": -5}), (OnebitAdamStrategy, {"warmup": 1.5}), (OnebitAdamStrategy, {"warmup": 0}),
    (OnebitAdamStrategy, {"warmup": "soon"}), (OnebitAdamStrategy, {"warmup": True}),
    (OnebitAdamStrategy, {"optimizer_kwargs": {"blok_size": 16}}),
    (OnebitAdamStrategy, {"optimizer_kwargs": {"block_size": -3}}),
    (OnebitAdamStrategy, {"optimizer_kwargs": {"warmup_comm_dtype": "int4"}}),
    (OnebitAdamStrategy, {"optimizer_kwargs": {"lr": 0.1}}),  # the returned optimizer's, converted
    (OnebitAdamStrategy, {"optimizer_kwargs": {"warmup_steps": 3}}),  # the strategy's warmup=
    (OnebitAdamStrategy, {"optimizer_kwargs": ["block_size"]}),
    (OnebitAdamStrategy, {"hierarchical": "auto"}), (OnebitAdamStrategy, {"strict_resume": 1}),
    (OnebitAdamStrategy, {"on_nonfinite": "ignore"}), (OnebitAdamStrategy, {"max_consecutive_skips": 0}),
    (OnebitAdamStrategy, {"max_consecutive_skips": 2.0}), (OnebitAdamStrategy, {"clip_when_compressing": "yes"}),
    (CDAdamStrategy, {"warmup": 0.2}),  # no warm-up to set: it would be ignored
    (DiLoCoStrategy, {"sync_every": 0}), (DiLoCoStrategy, {"sync_every": 2.5}), (DiLoCoStrategy, {"outer_lr": "x"}),
    (DiLoCoStrategy, {"outer_lr": -1.0}), (DiLoCoStrategy, {"outer_momentum": 1.0}), (DiLoCoStrategy, {"nesterov": 1}),
    (DiLoCoStrategy, {"compression": "3bit"}), (DiLoCoStrategy, {"fragments": 32}), (DiLoCoStrategy, {"overlap": -1}),
    (DiLoCoStrategy, {"mixing": 1.5}), (DiLoCoStrategy, {"keep_local": "no"}), (DiLoCoStrategy, {"on_nonfinite": "x"}),
    (DiLoCoStrategy, {"hierarchical": "auto"}), (DiLoCoStrategy, {"offload": "yes"}),
    (HookDDPStrategy, {"kind": "powersgd", "rank": 0}), (HookDDPStrategy, {"kind": "powersgd", "start_iter": 1}),
    (HookDDPStrategy, {"kind": "powersgd", "start_iter": 1.5}),
    (HookDDPStrategy, {"kind": "fp16", "min_compression_rate": -1}),
    (HookDDPStrategy, {"kind": "fp16", "min_compression_rate": "a"}),
]


@pytest.mark.parametrize("cls,kwargs", BAD_OPTIONS, ids=[f"{c.__name__}-{k}" for c, k in BAD_OPTIONS])
def test_a_bad_option_fails_in_the_constructor_naming_it_and_its_value(cls, kwargs):
    option, value = [(k, v) for k, v in kwargs.items() if k != "kind"][0]
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    msg = str(info.value)
    shown = repr(next(iter(value))) if isinstance(value, dict) else repr(value)  # optimizer_kwargs: the bad name
    assert option in msg and shown in msg, msg


def test_the_checked_optimizer_kwargs_are_kept_and_reach_the_conversion():
    strategy = CompressedDDPStrategy("zero_one_adam", optimizer_kwargs={"var_freeze_step": 0.15, "block_size": 16})
    new = strategy._convert(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]))
    assert new.schedule_args["var_freeze_step"] == 0.15 and new.block_size == 16


# -- the warm-up, resolved in one place ------------------------------------------------------------------
def test_one_warmup_resolver_for_the_strategies_the_callback_and_the_recipes():
    from recipes.algorithms import resolve_warmup as recipe_warmup

    for value, total, steps in ((5, 100, 5), (0.15, 37, 6), (0.01, 20, 1), ("auto", 100, None)):
        check_warmup(value)
        assert resolve_warmup(value, total) == steps
        if steps is not None:
            assert recipe_warmup(value, total) == steps
    with pytest.raises(ValueError, match=r"warmup=0.15 is a fraction of the run, but the number of steps is unknown"):
        resolve_warmup(0.15, float("inf"))
    for bad in (0, -1, 1.0, "soon", True):
        for make in (check_warmup, PhaseSwitch, lambda w: OnebitAdamStrategy(warmup=w)):
            with pytest.raises(ValueError, match=r"warmup must be an int >= 1 \(steps\), a float in \(0, 1\)"):
                make(bad)
    with pytest.raises(ValueError, match="needs algorithm.warmup"):
        recipe_warmup(None, 10)
    with pytest.raises(ValueError, match="algorithm.warmup must be an int >= 1"):
        recipe_warmup(2.0, 10)


def test_second_moments_are_the_flat_buffers_the_auto_switch_reads():
    p = torch.nn.Parameter(torch.ones(6))
    opt = OnebitAdam([p], warmup_steps=5)
    assert opt.second_moments() == []  # no buckets before the first step
    p.grad = torch.full((6,), 2.0)
    opt.step()
    (v,) = opt.second_moments()
    assert opt.second_moments()[0] is v  # the buffer kept, not a copy
    assert torch.allclose(v[:6], torch.full((6,), (1 - 0.999) * 4.0))  # AdamW's v after one step of g = 2


# -- comm.agree ----------------------------------------------------------------------------------------
def _agree(rank: int, world_size: int):
    from lightning_onebit.comm import all_ranks, gather_objects, is_distributed, max_across_, sum_across_

    flat = sum_across_(torch.tensor([0.1 * (rank + 1), 2.0**50 + rank], dtype=torch.float64))
    return (is_distributed(), gather_objects({"rank": rank}), max_across_(torch.tensor([float(rank), -rank])).tolist(),
            flat.tolist(), all_ranks(True), all_ranks(rank == 0))


def test_agreements_across_ranks_and_in_one_process():
    from lightning_onebit.comm import all_ranks, gather_objects, is_distributed, max_across_, sum_across_

    from dist_utils import run_ranks, values

    for got in values(run_ranks(_agree, 2)):
        assert got == (True, [{"rank": 0}, {"rank": 1}], [1.0, 0.0], [0.1 + 0.2, 2.0**51 + 1], True, False)
    t = torch.tensor([3.0])
    assert not is_distributed() and gather_objects(7) == [7] and all_ranks(True) and not all_ranks(False)
    assert max_across_(t) is t and sum_across_(t) is t and t.item() == 3.0
