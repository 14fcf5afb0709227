"""`python -m phase1_baseline.run`: the phase's benchmark, profile and plots (see profile_pytorch)."""

import sys

from phase1_baseline.profile_pytorch import main

if __name__ == "__main__":
    sys.exit(main())
