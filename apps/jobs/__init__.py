"""Batch jobs over a file of texts, for every app: resumable on one machine (`runner`), and the
same unit of work per block of lines on a Ray cluster (`ray_jobs`).

Kept free of imports, so that importing one module does not import the other (nor Ray)."""
