"""The RL math, as pure functions: advantages (`advantage`), episodes -> samples (`samples`), token weights,
KL and the PPO-clip loss (`loss`). Exact formulas live in each module's docstring.

Import the modules directly; `samples` and `advantage` are pure Python, only `loss` imports torch.
"""
