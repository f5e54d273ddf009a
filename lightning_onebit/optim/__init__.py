"""The optimizers: 1-bit Adam, 0/1 Adam, 1-bit LAMB, QAdam, CD-Adam and baselines, and DiLoCo.

Each optimizer class registers its strategy name (``CompressedOptimizer.algorithms()``)."""

from .base import CollectiveError, CompressedOptimizer, NonFiniteGradientError, check_hyperparameters
from .baselines import EF21, ErrorFeedbackAMSGrad, NaiveCompressedAMSGrad
from .cd_adam import CDAdam
from .diloco import DiLoCo
from .onebit_adam import OnebitAdam
from .onebit_lamb import OnebitLamb
from .qadam import QAdam
from .sharded import ShardedCompressed
from .zero_one_adam import ZeroOneAdam, ZeroOneSchedule

__all__ = ["CDAdam", "CompressedOptimizer", "DiLoCo", "EF21", "ErrorFeedbackAMSGrad", "NaiveCompressedAMSGrad",
           "CollectiveError", "NonFiniteGradientError", "OnebitAdam", "OnebitLamb", "QAdam", "ShardedCompressed",
           "ZeroOneAdam", "ZeroOneSchedule", "check_hyperparameters"]
