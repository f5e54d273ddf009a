"""The compressed optimizers: 1-bit Adam, 1-bit LAMB, QAdam, CD-Adam and baselines."""

from .base import CompressedOptimizer, NonFiniteGradientError
from .cd_adam import EF21, CDAdam, ErrorFeedbackAMSGrad, NaiveCompressedAMSGrad
from .onebit_adam import OnebitAdam, QAdam
from .onebit_lamb import OnebitLamb

__all__ = ["CDAdam", "CompressedOptimizer", "EF21", "ErrorFeedbackAMSGrad", "NaiveCompressedAMSGrad",
           "NonFiniteGradientError", "OnebitAdam", "OnebitLamb", "QAdam"]
