"""The model's forward over the KV store (`forward`), the numerics it runs in (`backend`: exact,
packed, int8; chosen once per model and machine) and the measured cost of a step (`calibration`)."""
