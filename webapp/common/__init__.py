"""Pieces shared by every Temper app: the abstract base model, ownership, errors."""
