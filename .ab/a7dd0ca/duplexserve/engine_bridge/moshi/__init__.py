"""The moshi engine: Kyutai's Mimi + LM batched over fixed slots (torch imported lazily)."""
