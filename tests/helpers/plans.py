"""Model configs and run settings the plan tests share (config.json values as published on the Hugging Face Hub:
only the keys a plan reads, plus the type)."""

QWEN25_32B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
              "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
              "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 1000000.0}

# What the big examples run with (examples/*.sh): long responses, one sequence per microbatch.
RUN = ["optim.micro_batch_size=1", "engine.max_model_len=4096", "optim.logprob_chunk=1024",
       "rollout.prompts_per_step=32", "rollout.samples_per_prompt=8", "engine.slots=64"]
