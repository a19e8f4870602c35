"""atexit handlers and non-daemon threads still running when the script's code ends."""

import atexit
import threading
import time


def late(name: str, delay: float) -> None:
    time.sleep(delay)
    print(f"thread {name} finished", flush=True)


atexit.register(print, "atexit 1 (registered first, runs last)")
atexit.register(print, "atexit 2 (registered last, runs first)")
threading.Thread(target=late, args=("a", 0.3)).start()
threading.Thread(target=late, args=("b", 0.6)).start()
threading.Thread(target=late, args=("daemon", 60), daemon=True).start()
print("end of the script's code")
