"""Mixture-of-experts building blocks a model plugin assembles: the layer (router, grouped experts, shared
experts) and the routing bookkeeping its plugin object keeps (balancing bias, load metrics, idle experts)."""
