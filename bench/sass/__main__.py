"""`python -m kvnumba.bench.sass`."""
from .report import main

raise SystemExit(main())
