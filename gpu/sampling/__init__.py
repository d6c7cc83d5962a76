"""The sampling pipeline: SamplingMetadata once per step (MetadataCache reuses it while the batch is unchanged),
then Sampler()(logits, metadata)."""

from .logprobs import LogprobsTensors
from .metadata import MetadataCache, SamplingMetadata, SamplingRow, reads_output, to_device
from .sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "MetadataCache",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "reads_output",
    "to_device",
]
