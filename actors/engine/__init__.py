"""The engine: scheduling (block manager, requests, scheduler) and the scheduler actor."""
