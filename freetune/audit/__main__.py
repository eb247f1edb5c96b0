"""python -m freetune.audit: see freetune.audit.cli."""

from freetune.audit.cli import main

raise SystemExit(main())
