"""lightning_onebit: communication-compressed data-parallel training for Lightning."""

from .optim import EF21, CDAdam, ErrorFeedbackAMSGrad, NaiveCompressedAMSGrad, OnebitAdam, OnebitLamb, QAdam

__version__ = "0.1.0"
__all__ = ["CDAdam", "EF21", "ErrorFeedbackAMSGrad", "NaiveCompressedAMSGrad", "OnebitAdam", "OnebitLamb",
           "QAdam"]
