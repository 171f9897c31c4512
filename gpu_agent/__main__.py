from gpu_agent.cli import main

raise SystemExit(main())
