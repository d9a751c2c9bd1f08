"""What every actor process of a run has: the watchdog's stack dumps (stacks.py), heap trimming
(heap.py) and the faults tests inject (testhooks.py)."""
