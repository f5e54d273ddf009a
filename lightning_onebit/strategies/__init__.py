"""Lightning strategies; importing this module registers the strategy names."""

from lightning.pytorch.strategies import StrategyRegistry

from .compressed import ALGORITHMS, CompressedDDPStrategy, destroy_process_group_at_exit


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


CompressedDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["ALGORITHMS", "CDAdamStrategy", "CompressedDDPStrategy", "OnebitAdamStrategy", "OnebitLambStrategy",
           "QAdamStrategy", "destroy_process_group_at_exit"]
