"""titan-core's chat fine-tuning plugin: conversations rendered with the chat template, the loss on the replies (docs/plugins/sft.md)."""
