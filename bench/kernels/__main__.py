"""`python -m kvnumba.bench.kernels`."""
from .run import main

raise SystemExit(main())
