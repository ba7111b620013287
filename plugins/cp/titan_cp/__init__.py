"""titan-core plugin ``cp``: context parallel (ring attention) for the core's Llama."""
