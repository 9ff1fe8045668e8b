"""Training: engines (single, DDP, DeepSpeed), the loop, EMA, evaluation during training, run directories, logging."""

from diffcurr_fast._lazy import lazy_exports

# name -> module, imported on first use: importing one submodule does not import the whole package (torch)
_EXPORTS: dict[str, str] = {
    "TrainBatches": "diffcurr_fast.train.data",
    "build_train_batches": "diffcurr_fast.train.data",
    "load_init_weights": "diffcurr_fast.train.data",
    "EMA": "diffcurr_fast.train.ema",
    "DDPEngine": "diffcurr_fast.train.engine",
    "DeepSpeedEngine": "diffcurr_fast.train.engine",
    "Engine": "diffcurr_fast.train.engine",
    "create_engine": "diffcurr_fast.train.engine",
    "resolve_deepspeed_config": "diffcurr_fast.train.engine",
    "NonFiniteLossError": "diffcurr_fast.train.skips",
    "Trainer": "diffcurr_fast.train.loop",
    "lr_at": "diffcurr_fast.train.loop",
    "train": "diffcurr_fast.train.loop",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "EMA",
    "DDPEngine",
    "DeepSpeedEngine",
    "Engine",
    "NonFiniteLossError",
    "TrainBatches",
    "Trainer",
    "build_train_batches",
    "create_engine",
    "load_init_weights",
    "lr_at",
    "resolve_deepspeed_config",
    "train",
]
