"""The shared speculative core: draft-then-verify decoding, drafters, model provisioning.

Subpackages (docs/architecture-core.md): `scheduler` (the loop, sequences, KV stores), `model`
(the forward, the backend, step timings), `kernels` (projection and attention forms) and
`speculation` (drafts, drafters, verification). The names a user needs are here."""

from .model.backend import choose_backend
from .scheduler.chat import chat_prompt_ids
from .scheduler.engine import BatchEngine, EngineConfig, Request
from .scheduler.generate import Generation, GenerationStats, eos_token_ids, generate, turn_end_token
from .scheduler.prefix_cache import PrefixCache
from .scheduler.sequence import SamplingParams
from .scheduler.streaming import TextAssembler, TextPiece, stream
from .speculation.draft import AdaptiveLength, Draft, Drafter, FallbackDrafter, NoDrafter
from .speculation.draft_budget import DraftPolicy
from .speculation.draft_model import DraftModelDrafter
from .speculation.prompt_lookup import NgramIndex, PromptLookupDrafter
from .speculation.verify import Sampling, verify_greedy, verify_sample

__all__ = [
    "AdaptiveLength", "BatchEngine", "Draft", "DraftPolicy", "Drafter", "EngineConfig", "FallbackDrafter", "NoDrafter", "DraftModelDrafter",
    "Generation", "GenerationStats", "NgramIndex", "PrefixCache", "PromptLookupDrafter", "Request", "Sampling", "SamplingParams",
    "TextAssembler", "TextPiece", "chat_prompt_ids", "choose_backend", "eos_token_ids", "generate", "stream",
    "turn_end_token", "verify_greedy", "verify_sample",
]
