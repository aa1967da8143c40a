from dspark.cli.main import main

raise SystemExit(main())
