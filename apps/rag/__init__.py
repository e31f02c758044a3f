"""Retrieval-augmented question answering with reference drafts (qa.py)."""

DRAFTERS = ("reference", "prompt-lookup", "none")  # how RagQA drafts; named here for the CLI
# Retrieved passages scoring under this share of the best one's are left out of the prompt
# (`retrieval.relevant`): on a corpus of many topics most of the k are off-topic, and every prompt
# token is prefill time (docs/benchmarks.md, RAG under load).
DEFAULT_MIN_RELEVANCE = 0.5
