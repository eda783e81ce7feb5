"""A search decides: the space, the rules, the memory model and speed prior, the planner, the
proposal policy (an Optuna sampler), pruning and stopping, confirmation, and the loop that ties them.
"""
