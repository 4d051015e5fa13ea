"""`astuner eval`: run the workflow and judge on a split with one or more models and report pass@k.

`runner` holds the rollouts and the report; the math (pass@k, the paired confidence interval) is
`astuner/algorithm/pass_at_k.py`, which validation during training uses too.
"""
