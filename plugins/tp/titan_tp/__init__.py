"""titan-core plugin ``tp``: tensor parallel for the core's Llama."""
