"""HF <-> Megatron checkpoint conversion (`mm-adaptor convert`), streaming shard by shard over a per-family mapping table."""
