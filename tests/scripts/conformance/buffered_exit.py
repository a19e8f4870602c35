"""Output still in the buffer at exit (run without -u) is flushed, after atexit's."""

import atexit
import sys

atexit.register(lambda: sys.stdout.write("from atexit\n"))
sys.stdout.write("buffered line 1\n")
sys.stdout.write("buffered line 2\n")
