"""sys.exit(3) from inside a function, with a finally block and an atexit handler."""

import atexit
import sys

atexit.register(print, "atexit ran")


def main() -> None:
    try:
        sys.exit(3)
    finally:
        print("finally ran")


main()
