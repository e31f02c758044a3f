"""The benchmarks, apart from the product: `specsuite bench TASK` (cli.py: against HF `generate()`;
batch.py, peers.py, serve.py, serve_load.py), `specsuite bench-ray` (ray_job.py) and
`specsuite bench-openai` (openai_server.py); their task loaders with them (rag_task.py)."""
