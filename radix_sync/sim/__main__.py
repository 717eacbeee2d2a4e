"""`python -m radix_sync.sim ...`: the simulator without the `kvrep` wrapper."""

import argparse
import sys

from radix_sync.sim.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m radix_sync.sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
