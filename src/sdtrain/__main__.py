from sdtrain.cli.main import main

raise SystemExit(main())
