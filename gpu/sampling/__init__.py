"""The sampling pipeline: SamplingMetadata once per step (MetadataCache reuses it while the batch is unchanged),
then Sampler()(logits, metadata). Beside the model stack (rank 1 of gpu/): imports torch and its own modules only
(threshold_triton.py imports Triton, once chosen); the worker and the runner's callers import it."""

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
