"""The loop: requests in, sequences in slots, one forward a step, results out (`engine.BatchEngine`:
add_request / step / abort), the KV store the sequences live in (`kv`), one sequence's state and
stopping (`sequence`), `generate()` on one sequence, streaming text and chat prompts."""
