"""Rollout engines: the engine interface and its vLLM implementation."""
