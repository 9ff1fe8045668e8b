"""The shipped training recipes, installed as package data (``diffcurr-fast recipes`` lists them)."""
