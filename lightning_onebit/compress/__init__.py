"""Pure tensor codecs: bits in, bits out. No torch.distributed here."""

from .codecs import Codec, Encoded, MinMaxCodec, MinMaxUInt8Codec, SignCodec
from .compile import compile_kernels
from .kernels import BACKENDS, ENV_VAR
from .memory import flat_buffer
from .source import Source
from .topk import TopKCodec

__all__ = ["BACKENDS", "ENV_VAR", "Codec", "Encoded", "MinMaxCodec", "MinMaxUInt8Codec", "SignCodec", "Source",
           "TopKCodec", "compile_kernels", "flat_buffer"]
