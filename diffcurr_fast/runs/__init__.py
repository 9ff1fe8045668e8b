"""The run layer below train and eval: the run config, checkpoint I/O, model building and image sampling."""
