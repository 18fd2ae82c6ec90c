"""Errors that services raise and the API turns into clear HTTP answers."""

from __future__ import annotations

from typing import Any


class TemperError(Exception):
    """Base of the errors a person can act on: the message says what was wrong and what to do."""

    status_code = 400

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidTransition(TemperError):
    """A lifecycle action that the object's current state does not allow (HTTP 409)."""

    status_code = 409


class ValidationFailed(TemperError):
    """Input that failed validation; ``details`` lists every problem found (HTTP 400)."""

    status_code = 400
