"""The engine: requests, their sequences, the batch scheduler, a round's bookkeeping.

engine.py runs draft-then-verify rounds over a target backend; scheduler.py batches the
sequences of several requests into one target decode per step."""
