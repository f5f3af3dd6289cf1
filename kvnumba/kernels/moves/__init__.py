"""Kernels that move K/V and page tables: the K/V write through the page tables (`write`,
`write_fp8`), runs of rows copied for clones and copy-on-write (`page_copy`), and a step's
page-table patches (`page_table`)."""
