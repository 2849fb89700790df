"""Distributed: Ray worker groups that run the training loop on many devices (`cluster`). Sits above `train/`
(its workers call the loop's update) and below the stage entry points in `recipe`."""
