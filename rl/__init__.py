"""The learner: continual pre-training and asynchronous-RL training of the MoE decoder.

Modules: objectives (losses), train_state / train_step / learner (sharded training core),
checkpointing (orbax), episodes / trajectory_io / rl_data / pretrain_data (grain pipelines),
trainer (the loop), flops (MFU), multihost_smoke (multi-process check).
"""
