"""single process (standalone Checkpointer, persister in-process): an object in the
state that pickles but cannot be unpickled where the persister runs. Shows (1) wait() does not fail
fast, (2) after two failed durable persists, the next durable save blocks (slots never released)."""

import shutil
import sys
import threading
import time

import torch

import trainguard


def _fail():
    raise AttributeError(
        "Can't get attribute 'Progress' (simulated: class not importable in the persister)"
    )


class Unloadable:
    def __reduce__(self):
        return (_fail, ())


root = sys.argv[1]
shutil.rmtree(root, ignore_errors=True)
state = {"w": torch.zeros(1000), "obj": Unloadable()}
ck = trainguard.Checkpointer(root, durable_every=1)
ck.save(1, state)
t = time.time()
try:
    ck.wait(timeout_s=5)
    print("wait: returned (durable)")
except Exception as e:
    print(f"wait(timeout_s=5) raised after {time.time() - t:.1f}s: {type(e).__name__}: {e}")
ck.save(2, state)
time.sleep(1)
done = threading.Event()


def third():
    ck.save(3, state)
    done.set()


th = threading.Thread(target=third, daemon=True)
th.start()
print(f"third durable save returned within 20 s: {done.wait(20)}")
print("events:", [k for k, _ in ck._backend.events][:6])
sys.stdout.flush()
for p in ck._backend.paths:
    p.unlink(missing_ok=True)
    (p.parent / (p.name + ".sum")).unlink(missing_ok=True)
import os

os._exit(0)
