"""Training of the bundled model pair (tools/train_bundled.py is the command; docs/bundled_model.md the plan)."""
