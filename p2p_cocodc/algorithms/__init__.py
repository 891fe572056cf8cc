"""The algorithm core: fragments, outer optimizer, schedules, delay compensation, strategies.

Pure torch, no I/O, no asyncio, no networking: the simulator and the peer drive the same objects.
"""
