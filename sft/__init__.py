"""sft: full-parameter supervised fine-tuning of Hugging Face causal LMs with FSDP2."""
