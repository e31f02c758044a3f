"""Retrieval-augmented question answering with reference drafts (qa.py)."""

DRAFTERS = ("reference", "prompt-lookup", "none")  # how RagQA drafts; named here for the CLI
