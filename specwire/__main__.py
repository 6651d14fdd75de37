from specwire.cli import main

raise SystemExit(main())
