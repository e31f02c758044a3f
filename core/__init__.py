"""The shared speculative core: draft-then-verify decoding, drafters, model provisioning."""

from .draft import AdaptiveLength, Draft, Drafter, FallbackDrafter, NoDrafter
from .draft_model import DraftModelDrafter
from .generate import Generation, GenerationStats, eos_token_ids, generate, turn_end_token
from .prefix_cache import PrefixCache
from .streaming import TextAssembler, TextPiece, stream
from .prompt_lookup import NgramIndex, PromptLookupDrafter
from .verify import Sampling, verify_greedy, verify_sample

__all__ = [
    "AdaptiveLength", "Draft", "Drafter", "FallbackDrafter", "NoDrafter", "DraftModelDrafter", "Generation",
    "GenerationStats", "eos_token_ids", "generate", "NgramIndex", "PromptLookupDrafter", "PrefixCache", "Sampling", "TextAssembler",
    "TextPiece", "stream", "turn_end_token", "verify_greedy", "verify_sample",
]
