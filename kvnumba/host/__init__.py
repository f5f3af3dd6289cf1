"""Host planes: everything worked out on the host, in NumPy and compiled host code, that
never touches a device: page accounting over the layer kinds' page groups
(`page_accounting`), the slot table and the step machine (`slots`), the prefix index
(`prefix_index`), a step's host state (`step`) and `declare_step`'s planning
(`declarer`)."""
