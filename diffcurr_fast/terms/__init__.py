"""Training terms beyond the regression loss: the interface (``base``) that the objective runs them through."""
