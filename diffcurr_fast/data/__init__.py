"""Data: latent layouts, image folders with ADM preprocessing, one shared sample order, DALI and torch loaders.

DALI is optional and imported only when a DALI backend is used.
"""
