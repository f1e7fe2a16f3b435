"""The megatron-core trainer: parallel state, model building, logprobs, optimizer."""
