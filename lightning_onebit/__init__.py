"""lightning_onebit: communication-compressed data-parallel training for Lightning.

``import lightning_onebit`` registers the strategies ``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``,
``qadam``, ``cd_adam``, ``ef21``, ``ef_amsgrad`` and ``naive_amsgrad`` (plus ``*_spawn`` variants) with
Lightning's ``StrategyRegistry``.
"""

from .callbacks import CommunicationMonitor, PhaseSwitch, ReplicaSync
from .optim import (
    EF21,
    CDAdam,
    DiLoCo,
    ErrorFeedbackAMSGrad,
    NaiveCompressedAMSGrad,
    OnebitAdam,
    OnebitLamb,
    QAdam,
    ZeroOneAdam,
)
from .strategies import (
    BaseDDPStrategy,
    CDAdamStrategy,
    CompressedDDPStrategy,
    DiLoCoStrategy,
    OnebitAdamStrategy,
    OnebitLambStrategy,
    QAdamStrategy,
    ZeroOneAdamStrategy,
)

__version__ = "0.1.0"
__all__ = ["BaseDDPStrategy", "CDAdam", "CDAdamStrategy", "CommunicationMonitor", "CompressedDDPStrategy", "DiLoCo",
           "DiLoCoStrategy", "EF21",
           "ErrorFeedbackAMSGrad", "NaiveCompressedAMSGrad", "OnebitAdam", "OnebitAdamStrategy", "OnebitLamb",
           "OnebitLambStrategy", "PhaseSwitch", "QAdam", "QAdamStrategy", "ReplicaSync", "ZeroOneAdam",
           "ZeroOneAdamStrategy"]
