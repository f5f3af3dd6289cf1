"""The data plane: what moves between the caller's arrays and the device storage in a step.
Arrays in and out (`arrays`), the device storage and page tables (`storage`), the step's one
upload (`upload`), which kernel serves which segments (`routing`), and the checked `write` /
`attend` / `update_and_attend` of a prepared step (`attend`)."""
