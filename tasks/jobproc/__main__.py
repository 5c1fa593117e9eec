"""``python -m tasks.jobproc <fd>``: a job process (see :mod:`tasks.jobproc`)."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
