"""A model's tensors in files: how the safetensors files transformers saves lay them out (`layout`),
reading this rank's shards from them or from the architecture's random init (`weights`), a
vision-language checkpoint's file names and kept tensors (`vision_language`), a base's identity
(`identity`) and the tokenizer (`tokenizer`)."""
