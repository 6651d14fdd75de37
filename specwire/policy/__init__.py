"""How many tokens to draft: the cost model (throughput.py), the adaptive policy
(adaptive.py) and the planner of a deployment (plan.py)."""
