"""Which megatron-core the patches fit: each target's fingerprint per release (fingerprint_table, generated), how a
fingerprint is read from source (source_fingerprint), the contract a patch checks before it applies (contracts), and
which features serve on the installed release (serving)."""
