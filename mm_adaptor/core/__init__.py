"""The machinery every part builds on, importing none of them: the feature registry, patching, the one-line errors,
the command parser, the model unwrapper and the record of where each feature ran."""
