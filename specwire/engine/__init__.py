"""The engine: requests, their sequences, the batch scheduler, a round's logic, the
target's costs.

engine.py holds the Engine and the caller's handle (Generation) and runs one step:
schedule, draft, one target decode, postprocess. request.py is what a caller asks
for, sequence.py a running sequence's state, scheduler.py the batch's parts, round.py
one sequence's part of a step, costs.py what the target's decodes cost."""
