"""Drafts and their verification: the draft tree (`draft`), drafters (prompt lookup, a draft
model), greedy and sampled verification (`verify`) and the draft budget by step cost
(`draft_budget`). Imports nothing else of the core: the loop and the model use it."""
