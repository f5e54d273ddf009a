"""lightning_onebit: communication-compressed data-parallel training for Lightning.

Two families share one synchronisation layer (:mod:`lightning_onebit.comm`): the Adam family compresses
every step's momentum or gradient (1-bit Adam, 1-bit LAMB, 0/1 Adam, QAdam, CD-Adam and the CD-Adam paper's
baselines), and DiLoCo takes local steps and averages a compressed pseudo-gradient every few of them
(Streaming DiLoCo's fragments and overlap; local SGD with another inner optimizer).

``import lightning_onebit`` registers the strategies ``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``,
``qadam``, ``cd_adam``, ``ef21``, ``ef_amsgrad``, ``naive_amsgrad`` and ``diloco`` (plus ``*_spawn`` and
``*_forkserver`` variants), and ``diloco_fsdp``, ``onebit_adam_fsdp``, ``qadam_fsdp``, ``onebit_lamb_fsdp``,
``cd_adam_fsdp``, ``zero_one_adam_fsdp`` (FSDP2 inside each node), with Lightning's ``StrategyRegistry``.
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
    ShardedCompressed,
    ZeroOneAdam,
)
from .strategies import (
    BaseDDPStrategy,
    CDAdamStrategy,
    CompressedDDPStrategy,
    CompressedFSDPStrategy,
    DiLoCoFSDPStrategy,
    DiLoCoStrategy,
    OnebitAdamStrategy,
    OnebitLambStrategy,
    QAdamStrategy,
    ZeroOneAdamStrategy,
)

__version__ = "0.1.0"
__all__ = ["BaseDDPStrategy", "CDAdam", "CDAdamStrategy", "CommunicationMonitor", "CompressedDDPStrategy",
           "CompressedFSDPStrategy", "DiLoCo",
           "DiLoCoFSDPStrategy", "DiLoCoStrategy", "EF21",
           "ErrorFeedbackAMSGrad", "NaiveCompressedAMSGrad", "OnebitAdam", "OnebitAdamStrategy", "OnebitLamb",
           "OnebitLambStrategy", "PhaseSwitch", "QAdam", "QAdamStrategy", "ReplicaSync", "ShardedCompressed",
           "ZeroOneAdam", "ZeroOneAdamStrategy"]
