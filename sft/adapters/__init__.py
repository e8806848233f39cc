"""What trains beside a frozen base: LoRA adapters on Linear layers and routed experts, over a
bf16 or NF4 base (`lora`), and their files in PEFT's format (`peft_format`)."""
