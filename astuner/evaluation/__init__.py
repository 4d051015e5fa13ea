"""`astuner eval`: run the workflow and judge on a split with one or more models and report pass@k.

`metrics` holds the pure math (pass@k, the paired confidence interval), `runner` the rollouts and the report.
"""
