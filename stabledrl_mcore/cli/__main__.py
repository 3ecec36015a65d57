"""``python -m stabledrl_mcore.cli ...`` (torchrun and srun start ranks this way)."""

from stabledrl_mcore.cli.app import main

raise SystemExit(main())
