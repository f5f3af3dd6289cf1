"""Pure arithmetic, below the configuration: page counts and the page tables' compiled
passes (`pages`), positions, ring rows, floors and the segment table's layout
(`positions`), and the prefix index's chained page keys (`prefix_keys`). Integers and
NumPy arrays only: nothing here knows a slot state, a cache object or a device."""
