"""The main job: continual pre-training on code, asynchronous RL on coding tasks, evaluation."""
