"""The `ddtree-client` command."""
import sys
def main(argv=None):
    return 0
