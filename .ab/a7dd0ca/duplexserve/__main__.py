from duplexserve.cli import main

raise SystemExit(main())
