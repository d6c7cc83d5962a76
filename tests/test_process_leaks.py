"""What an actor process leaves behind when it ends without cleanup (os._exit, kill -9): no multiprocessing
semaphore for the resource tracker to find. tqdm's default write lock makes one wherever the start method is not
fork (an actor process is forked from the fork server: forkserver), so a child's progress bars must not use it
(actors/runtime/process.py, `one_process_progress_bars`). And what it keeps: the heap a step freed, which the next
step's tensors reuse without a page fault (`reuse_freed_heap`); and how often its cyclic GC runs once it has started,
over a heap its startup made (`settle_heap`)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import multiprocessing, os, sys
multiprocessing.set_start_method("forkserver")  # (an actor process's context)
if sys.argv[1] == "actor":
    from actors.runtime.process import one_process_progress_bars
    one_process_progress_bars()
from tqdm import tqdm
list(tqdm(range(3)))
os._exit(0)
"""


def ended_abruptly(kind: str) -> str:
    """The stderr of a process (and of its resource tracker, which holds the pipe until it ends) that showed a bar."""
    return subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, timeout=120).stderr


def test_an_actor_process_with_a_progress_bar_leaks_no_semaphore():
    assert "leaked semaphore" in ended_abruptly("plain")  # (the test's power: tqdm's default lock leaks)
    assert "leaked semaphore" not in ended_abruptly("actor")


HEAP = """
import ctypes, resource, sys, threading
import torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # (PR_SET_THP_DISABLE: 4 KiB pages, a fault each, whatever the system's THP)
torch.set_num_threads(1)  # (every page faulted by the thread counted)
if sys.argv[1] == "actor":
    from actors.runtime.process import reuse_freed_heap
    reuse_freed_heap()
else:  # (the test's power: every tensor over 1 MiB a fresh mapping, M_MMAP_THRESHOLD)
    ctypes.CDLL(None).mallopt(-3, 1 << 20)
def steps():  # (in a thread, as a pooler's or a worker's steps run)
    for _ in range(10):  # (the first few land on new heap pages: glibc reuses freed ones once it has ~64 MiB)
        torch.empty(2 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(20):
        torch.empty(2 << 20).fill_(1.0)  # (8 MiB: 2,048 pages)
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start(), thread.join()
"""


def test_a_steps_8_mib_tensors_reuse_the_heap_the_last_one_freed():
    def faults(kind: str) -> int:
        return int(
            subprocess.run([sys.executable, "-c", HEAP, kind], capture_output=True, check=True, timeout=120).stdout
        )

    assert faults("plain") > 20 * 2048 / 2
    assert faults("actor") < 20 * 2048 / 20


GC = """
import gc, sys, weakref
startup = [[i] for i in range(200_000)]  # (a loaded model's and a KV cache's tables: tracked objects that stay)
if sys.argv[1] == "actor":
    from actors.runtime.process import settle_heap
    settle_heap()
else:
    gc.collect()  # (the same start, CPython's thresholds: the test's power)
class Row:
    pass
collections, freed = [0], []
def count(phase, info):
    collections[0] += phase == "stop"
gc.callbacks.append(count)
kept = []
for i in range(300_000):  # (a step's objects: most dropped at once, some kept, a few garbage cycles)
    row = Row()
    if i % 10 == 0:
        kept.append([row])
    if i % 1_000 == 1:
        cycle = [Row()]
        cycle.append(cycle)
        weakref.finalize(cycle[0], freed.append, i)
        del cycle
print(collections[0], len(freed), gc.get_freeze_count() >= len(startup))
"""


def test_a_started_process_collects_its_garbage_cycles_rarely_and_never_scans_its_startup_heap():
    def run(kind: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", GC, kind], capture_output=True, check=True, text=True,
                              timeout=60).stdout.split()  # fmt: skip

    collections, freed, frozen = run("plain")
    assert int(collections) > 10 and frozen == "False"  # (CPython's 700: a collection every 700 kept objects)
    collections, freed, frozen = run("actor")
    assert 1 < int(collections) <= 5 and frozen == "True"  # (60,000 kept, 600 cycles: 20,000 between collections)
    assert int(freed) > 200  # (the garbage cycles made before the last collection: freed by it, not leaked)
