"""Model configs and run settings the plan tests share (config.json values as published on the Hugging Face Hub:
only the keys a plan reads, plus the type)."""

QWEN25_32B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
              "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
              "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 1000000.0}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False}

# What the big examples run with (examples/*.sh): long responses, one sequence per microbatch.
RUN = ["optim.micro_batch_size=1", "engine.max_model_len=4096", "optim.logprob_chunk=1024",
       "rollout.prompts_per_step=32", "rollout.samples_per_prompt=8", "engine.slots=64"]
