"""`python -m kvnumba.bench.kernels`: write, clone and attention kernels on a CUDA GPU. The
command (`run`), its sizes (`sizes`), its harness (`harness`), its peers (`peers`), its cases
(`moves`, `attention`) and its report (`report`)."""
