"""Lightning strategies; importing this module registers the strategy names.

:mod:`.ddp_hooks` holds the baselines: plain DDP with PyTorch's fp16/bf16/PowerSGD comm hooks;
:mod:`.launch` the DDPStrategy every one of them builds on, whose process group survives
``torchrun --max-restarts``."""

from lightning.pytorch.strategies import StrategyRegistry

from .compressed import ALGORITHMS, CompressedDDPStrategy
from .compressed_fsdp import CompressedFSDPStrategy
from .ddp_hooks import HookDDPStrategy, hook_strategy
from .diloco import DiLoCoStrategy
from .diloco_fsdp import DiLoCoFSDPStrategy
from .launch import BaseDDPStrategy, destroy_process_group_at_exit


class OnebitAdamStrategy(CompressedDDPStrategy):
    """``strategy="onebit_adam"``: DDP + :class:`~lightning_onebit.OnebitAdam`."""

    algorithm = "onebit_adam"


class OnebitLambStrategy(CompressedDDPStrategy):
    """``strategy="onebit_lamb"``: DDP + :class:`~lightning_onebit.OnebitLamb`."""

    algorithm = "onebit_lamb"


class QAdamStrategy(CompressedDDPStrategy):
    """``strategy="qadam"``: DDP + :class:`~lightning_onebit.QAdam`."""

    algorithm = "qadam"


class CDAdamStrategy(CompressedDDPStrategy):
    """``strategy="cd_adam"``: DDP + :class:`~lightning_onebit.CDAdam`."""

    algorithm = "cd_adam"


class ZeroOneAdamStrategy(CompressedDDPStrategy):
    """``strategy="zero_one_adam"``: DDP + :class:`~lightning_onebit.ZeroOneAdam`."""

    algorithm = "zero_one_adam"


CompressedDDPStrategy.register_strategies(StrategyRegistry)
DiLoCoStrategy.register_strategies(StrategyRegistry)
DiLoCoFSDPStrategy.register_strategies(StrategyRegistry)
CompressedFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["ALGORITHMS", "BaseDDPStrategy", "CDAdamStrategy", "CompressedDDPStrategy", "CompressedFSDPStrategy",
           "DiLoCoFSDPStrategy",
           "DiLoCoStrategy",
           "HookDDPStrategy", "OnebitAdamStrategy", "OnebitLambStrategy", "QAdamStrategy", "ZeroOneAdamStrategy",
           "destroy_process_group_at_exit", "hook_strategy"]
