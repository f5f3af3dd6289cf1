"""Serving over any BatchControl through its verbs alone: sessions mapped onto sequences
(`sessions`, the `SessionTable` composing the rest), the packing of their inputs into one
step (`packing`), the prefix-index side of sessions (`prefixes`), how a refusal names its
session (`refused`), and the step driver (`driver`). Nothing here imports a cache."""
