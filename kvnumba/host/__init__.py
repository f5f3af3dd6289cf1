"""Host planes: everything worked out on the host, in NumPy and compiled host code, that
never touches a device: page arithmetic and the compiled passes over host page tables
(`pages`), position, row and floor arithmetic and the segment table (`positions`), page
accounting (`page_accounting`), the slot table and the step machine (`slots`), the prefix
index and its keys (`prefix_index`, `prefix_keys`), a step's host state (`step`) and
`declare_step`'s planning (`declarer`)."""
