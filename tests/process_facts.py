"""``python -m tests.process_facts [EXIT_CODE | wait]``: prints what a process knows of itself as one
JSON line (for tests/test_forkserver.py), then exits with EXIT_CODE, or waits to be signalled."""

import json
import os
import random
import signal
import sys

facts = {
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "cwd": os.getcwd(),
    "argv": sys.argv[1:],
    "marker": os.environ.get("PROCESS_FACTS_MARKER"),
    "hash": hash("p2p-cocodc"),
    "random": random.random(),
    "main": sys.modules["__main__"].__spec__.name,
    "path0": sys.path[0],
}
print(json.dumps(facts), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1:] == ["wait"]:
    signal.pause()
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
