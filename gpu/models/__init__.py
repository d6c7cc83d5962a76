"""The architecture registry: config.json's `architectures` -> the family's model class (gpu/models/<family>.py), on
top of the families (decoder.py: what they share). Imports gpu/layers and below (rank 4); nothing below imports it:
gpu/loading and the runner's memory plan do."""

from gpu.models.decoder import CausalLM
from gpu.models.gemma2 import Gemma2ForCausalLM
from gpu.models.gemma3 import Gemma3ForCausalLM
from gpu.models.llama import LlamaForCausalLM
from gpu.models.mistral import MistralForCausalLM
from gpu.models.mixtral import MixtralForCausalLM
from gpu.models.phi3 import Phi3ForCausalLM
from gpu.models.qwen2 import Qwen2ForCausalLM
from gpu.models.qwen3 import Qwen3ForCausalLM
from gpu.models.qwen3_moe import Qwen3MoeForCausalLM

_FAMILIES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM,  # also SmolLM
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Phi3ForCausalLM,
    MixtralForCausalLM,
    Qwen3MoeForCausalLM,
)
REGISTRY: dict[str, type[CausalLM]] = {family.__name__: family for family in _FAMILIES}
