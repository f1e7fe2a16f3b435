"""Moving weights between layouts: Megatron shards ⇄ HF names ⇄ vLLM engines."""
