"""`python -m specwire`: the same entry point as the `specwire` script (subprocesses
such as bench's draft node start it this way, with this interpreter)."""

from specwire.cli.main import main

raise SystemExit(main())
