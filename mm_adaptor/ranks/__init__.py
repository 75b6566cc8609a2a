"""Local ranks: the launcher, how a rank starts and ends (forked from a preloaded server, or spawned), and the
digest of what the ranks print besides their own lines."""
