"""The embeddings cache: keys and values (pure), the merge of cached and computed vectors, the
stores (memory, Redis) and the guarded lookup in front of them."""
