"""Serving concurrent callers: one running batch shared by every caller (`batch_server.BatchServer`),
`specsuite serve` (`cli`): the OpenAI-compatible server (`server`) speaking the protocol of
`openai_api`, its counters (`metrics`), and the same server as a Ray Serve deployment (`ray_serve`).

Kept free of imports, so that `specsuite serve --help` loads no model code."""
