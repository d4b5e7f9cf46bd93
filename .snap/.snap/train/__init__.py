"""Training loop for the models in `models/` (run as `python -m train`)."""
