"""The sampling pipeline: SamplingMetadata once per step (MetadataCache reuses it while the batch is unchanged),
then Sampler()(logits, metadata). Beside the model stack (rank 1 of gpu/): imports torch, its own modules and
messages/sampling_params.py only (threshold_triton.py and fused_triton.py import Triton, once chosen); actors/engine imports it."""

from .logprobs import LogprobsTensors
from .metadata import MetadataCache, SamplingMetadata, SamplingRow, to_device
from .sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "MetadataCache",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "to_device",
]
