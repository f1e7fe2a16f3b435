"""Prompt sources: synthetic verifiable tasks and the data cursor a checkpoint saves."""
