"""specsuite: task-specialised LLM apps with lossless speculative decoding drafted from the input.

Packages: `specsuite.core` (the decoding loop, drafters, model presets), `specsuite.apps.gec`
(grammar correction), `specsuite.apps.rag` (retrieval-augmented QA), `specsuite.retrieval`.
"""

__version__ = "0.1.0"
