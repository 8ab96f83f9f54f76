"""``python -m minillm ...``: the ``minillm`` command (`minillm.cli.main`), the same in every way."""
import sys

from minillm.cli import main

if __name__ == "__main__":
    sys.exit(main())
