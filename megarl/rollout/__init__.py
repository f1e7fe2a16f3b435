"""Rollout: turning prompts into scored groups of samples (the SortedRL controller lives here)."""
