"""An uncaught exception from a nested call: traceback on stderr, exit 1."""


def inner() -> None:
    raise ValueError("bad value from the script")


def outer() -> None:
    inner()


print("before the error")
outer()
