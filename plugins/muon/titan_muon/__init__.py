"""titan-core plugin ``muon``: Muon for the hidden matrices, AdamW for the rest, orthogonalised across ranks."""
