"""The sampling pipeline: SamplingMetadata.build once per step, then Sampler()(logits, metadata)."""

from .logprobs import LogprobsTensors
from .metadata import SamplingMetadata, SamplingRow, child_seed, make_generator
from .sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "child_seed",
    "make_generator",
]
