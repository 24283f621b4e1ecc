from gradkit.cli import main

raise SystemExit(main())
