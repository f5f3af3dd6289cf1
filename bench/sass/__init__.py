"""`python -m kvnumba.bench.sass [--report | --check]`: the static sm_90a report of compiled
kernels and the budgets it is checked against. The command (`report`), SASS parsing into a
model (`model`), control flow (`flow`), main loops (`loops`), the kinds' figures (`figures`,
`attention`, `move`), the kernels specified (`specs`) and the budgets (`budget`)."""
