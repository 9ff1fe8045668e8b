"""Training: engines (single, DDP, DeepSpeed), the loop, EMA, evaluation during training, run directories, logging."""
