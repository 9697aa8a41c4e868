"""`python -m megatron_hpc ...` is `megatron-hpc ...` (torchrun starts workers this way)."""

import sys

from megatron_hpc.cli.main import main

sys.exit(main())
