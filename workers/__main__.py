"""`python -m workers generate ...` (the same command as `python -m adaptive_dist generate`)."""
import sys

from workers.cli import main

if __name__ == "__main__":
    sys.exit(main())
