"""A wall-clock stack sampler for one CLI call, so that calls.json can say where a slow
call spent its seconds (waiting included: a poll, a systemctl, a socket).

``start(OUT)`` samples the main thread every SAMPLE_S seconds until the process exits,
then writes OUT: the most frequent stacks (their last DEPTH frames) with their seconds.
``python sampler.py OUT -m MODULE ARGS...`` runs MODULE as ``python -m`` would, sampled.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import runpy
import sys
import threading
import time
import traceback

SAMPLE_S = 0.2
DEPTH = 10


def start(out: str) -> None:
    counts: collections.Counter[tuple[str, ...]] = collections.Counter()
    main_id = threading.main_thread().ident or 0
    t0 = time.monotonic()

    def sample() -> None:
        while True:
            time.sleep(SAMPLE_S)
            frame = sys._current_frames().get(main_id)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)[-DEPTH:]
            counts[tuple(f"{os.path.basename(s.filename)}:{s.lineno} {s.name}"
                         for s in stack)] += 1

    def dump() -> None:
        top = [{"s": round(n * SAMPLE_S, 1), "stack": list(k)}
               for k, n in counts.most_common(12)]
        with open(out, "w") as fh:
            json.dump({"wall_s": round(time.monotonic() - t0, 2), "top": top}, fh)

    threading.Thread(target=sample, daemon=True).start()
    atexit.register(dump)


def main() -> None:
    out, flag, module, *args = sys.argv[1:]
    assert flag == "-m", sys.argv
    start(out)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
