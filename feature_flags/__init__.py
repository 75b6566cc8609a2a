"""One module per feature: flags, defaults, requires/conflicts, validation, and the patches it applies."""
