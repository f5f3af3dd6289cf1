"""Serving over any BatchControl through its verbs alone: sessions and the packing of their
inputs into one step (`sessions`), and the step driver (`driver`). Nothing here imports a
cache."""
