"""Patches of megatron.core.transformer and the models' embeddings."""
