"""titan-core plugin ``chunked_loss``: cross entropy a chunk of tokens at a time."""
