import sys

from adaptive_dist.cli import main

if __name__ == "__main__":
    sys.exit(main())
