"""An uncaught KeyboardInterrupt: the interpreter ends by SIGINT (exit status -2)."""

print("about to be interrupted")
raise KeyboardInterrupt
