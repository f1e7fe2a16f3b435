"""Model families: tiny HF checkpoints for tests and the demo."""
