"""`python -m jetrl.train CONFIG [key=value ...]`."""

import sys

from jetrl.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
