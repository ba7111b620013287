"""titan-core's LoRA plugin: low-rank adapters, the base model frozen (docs/plugins/lora.md)."""
