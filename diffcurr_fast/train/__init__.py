"""Training: typed config, engines (single, DDP, DeepSpeed), the loop, EMA, checkpoints, logging, sampling."""

from diffcurr_fast.train.checkpoint import (
    atomic_save,
    export_safetensors,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from diffcurr_fast.train.config import TrainConfig, config_from_dict, config_to_yaml, demo_config, load_config
from diffcurr_fast.train.data import TrainBatches, build_train_batches, load_init_weights
from diffcurr_fast.train.ema import EMA
from diffcurr_fast.train.engine import DDPEngine, DeepSpeedEngine, Engine, create_engine, resolve_deepspeed_config
from diffcurr_fast.train.loop import NonFiniteLossError, Trainer, lr_at, train
from diffcurr_fast.train.sampling import build_model, build_schedule, sample, save_grid

__all__ = [
    "EMA",
    "DDPEngine",
    "DeepSpeedEngine",
    "Engine",
    "NonFiniteLossError",
    "TrainBatches",
    "TrainConfig",
    "Trainer",
    "atomic_save",
    "build_model",
    "build_schedule",
    "build_train_batches",
    "config_from_dict",
    "config_to_yaml",
    "create_engine",
    "demo_config",
    "export_safetensors",
    "latest_checkpoint",
    "list_checkpoints",
    "load_config",
    "load_checkpoint",
    "load_init_weights",
    "lr_at",
    "resolve_deepspeed_config",
    "sample",
    "save_checkpoint",
    "save_grid",
    "train",
]
