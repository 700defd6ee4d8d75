"""Coding environments: sandboxes (`envs.sandbox`), tasks (`envs.tasks`), the agent harness
(`envs.harness`), and beside them rewards (`reward`), reward-hack detection (`hacks`) and episode
metrics (`metrics`). envs imports nothing from the packages above it. See envs/README.md.
"""
