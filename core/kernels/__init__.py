"""The projections and attention whose rows round alike at every row count: oneDNN-packed exact
bf16/fp32 linear layers, int8 linear layers, exact attention, the logit screen, and the
linear-layer modules a backend swaps into its decoder (`linear.py`). Imports nothing else of the core."""
