"""The `magicube` command."""
import sys


def main(argv=None):
    print("magicube: nothing built yet", file=sys.stderr)
    return 2
