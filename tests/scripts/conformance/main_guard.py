"""The usual guard, and what a fresh interpreter says about the main module."""

import os
import sys

import torch


def describe() -> str:
    main = sys.modules["__main__"]
    return (
        f"name={__name__} spec={__spec__!r} file={os.path.basename(__file__)} "
        f"main_is_us={main.__dict__ is globals()} argv={sys.argv[1:]} "
        f"path0={sys.path[0] == os.path.dirname(os.path.abspath(__file__))} "
        f"builtins={type(__builtins__).__name__} doc={__doc__.split(',')[0]!r} "
        f"threads={torch.get_num_threads()}"
    )


if __name__ == "__main__":
    print(describe())
else:
    print("imported, not run")
