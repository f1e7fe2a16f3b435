"""Saving and resuming what a run needs: Megatron dist checkpoints of model and optimizer."""
